"""Decoding with a pruned K cache: the LeanK rule, the cache, the attention function and its backends."""
