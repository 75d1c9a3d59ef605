"""The model: loading the base model a mask names, the LeanKModel wrapper, and generate() with a LeanK cache."""
