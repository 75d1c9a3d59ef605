"""argparse types for the ``leank`` commands: a bad value is a usage error (exit 2, one line naming it)."""

from __future__ import annotations

import argparse


def positive_int(value: str) -> int:
    """An integer >= 1 (lengths, counts, batch sizes, threads)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def positive_int_list(value: str) -> list[int]:
    """``"2048,4096"``: comma-separated integers >= 1."""
    try:
        return [positive_int(x) for x in value.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{value!r}: {e} (give comma-separated integers >= 1)") from None


def fraction(value: str) -> float:
    """A number in [0, 1]."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return x


def utf8_text(value: str) -> str:
    """Text that can be encoded: a shell passes undecodable bytes as lone surrogates (PEP 383)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(
            f"not valid text: character {e.start} is an undecodable byte or lone surrogate "
            f"({value[e.start]!r}); give UTF-8 text"
        ) from None
    return value
