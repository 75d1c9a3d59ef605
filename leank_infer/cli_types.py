"""Argument types of the ``leank`` commands: a bad value is a usage error (exit 2, one line naming it).

The classes are type hints for the command signatures; :func:`register` teaches jsonargparse to parse
them with the functions below (imported lazily: importing this module pulls no parser in).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml


class UsageError(ValueError):
    """A bad command-line value or input file: the entry point prints its message alone and exits 2."""


class PositiveInt(int):
    """An integer >= 1 (lengths, counts, batch sizes, threads)."""


class PositiveIntList(list):
    """``"2048,4096"``: comma-separated integers >= 1."""


class Fraction(float):
    """A number in [0, 1]."""


def positive_int(value: Any) -> int:
    """An integer >= 1 (lengths, counts, batch sizes, threads)."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def positive_int_list(value: Any) -> list[int]:
    """``"2048,4096"``: comma-separated integers >= 1."""
    if isinstance(value, list):
        value = ",".join(map(str, value))
    value = str(value)
    try:
        return [positive_int(x) for x in value.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{value!r}: {e} (give comma-separated integers >= 1)") from None


def fraction(value: Any) -> float:
    """A number in [0, 1]."""
    try:
        x = float(value)
    except (TypeError, ValueError):
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


def check_text(flag: str, value: str) -> str:
    """``value`` if it is valid text, else a UsageError naming ``flag``."""
    try:
        return utf8_text(value)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"{flag}: {e}") from None


MAX_CONFIG_BYTES = 1 << 20


def yaml_mapping_file(path: str | Path, what: str = "recipe") -> dict[str, Any]:
    """A YAML file's mapping; a missing, binary, huge or non-mapping file is one UsageError naming it."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{what} {str(path)!r}: no such file")
    if not path.is_file():
        raise UsageError(f"{what} {str(path)!r} is not a regular file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise UsageError(f"{what} {path} is {path.stat().st_size:,} bytes; a {what} is a YAML file of at most 1 MiB")
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"{what} {path} is not UTF-8 text (a binary file?); give a YAML {what}") from None
    except yaml.YAMLError as e:
        raise UsageError(f"{what} {path} is not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise UsageError(f"{what} {path} nests too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{what} {path} holds a YAML {type(data).__name__}; a {what} is a mapping of keys")
    return data


def _checked(parse):
    def deserialize(value: Any) -> Any:
        try:
            return parse(value)
        except argparse.ArgumentTypeError as e:
            raise ValueError(str(e)) from None

    return deserialize


_REGISTERED = False


def register() -> None:
    """Teach jsonargparse the types above (once)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from jsonargparse.typing import register_type

    register_type(PositiveInt, int, _checked(positive_int))
    register_type(PositiveIntList, lambda v: ",".join(map(str, v)), _checked(positive_int_list))
    register_type(Fraction, float, _checked(fraction))
    _REGISTERED = True
