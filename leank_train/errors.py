"""The error a bad recipe or training input raises: the CLIs print its message alone, without a traceback."""

from __future__ import annotations


class RecipeError(ValueError):
    """A recipe value or input (path, tokenizer, length) that cannot work; the message names it and the fix."""
