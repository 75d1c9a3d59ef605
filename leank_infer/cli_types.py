"""Argument types of the ``leank`` commands: a bad value is a usage error (exit 2, one line naming it).

The classes are type hints for the command signatures; :func:`register` teaches jsonargparse to parse
them with the functions below (imported lazily: importing this module pulls no parser in).
"""

from __future__ import annotations

import argparse
import re
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml


class UsageError(ValueError):
    """A bad command-line value or input file: the entry point prints its message alone and exits 2."""


class PositiveInt(int):
    """An integer >= 1 (lengths, counts, batch sizes, threads)."""


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
MAX_YAML_NODES = 100_000  # a recipe has hundreds; YAML aliases can multiply a 515-byte file into billions
MAX_INCLUDES = 8  # `config:` includes followed from one recipe


def _expanded_nodes(node: Any) -> int:
    """How many nodes the YAML graph under ``node`` has once its aliases are expanded (memoised: linear time)."""
    import yaml

    sizes: dict[int, int] = {}
    order, stack = [], [node]
    while stack:  # post-order without recursion
        n = stack.pop()
        if id(n) in sizes:
            continue
        sizes[id(n)] = 0
        order.append(n)
        if isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)
        elif isinstance(n, yaml.MappingNode):
            stack.extend(x for pair in n.value for x in pair)
    for n in reversed(order):
        children = n.value if isinstance(n, yaml.SequenceNode) else (
            [x for pair in n.value for x in pair] if isinstance(n, yaml.MappingNode) else [])
        sizes[id(n)] = min(1 + sum(sizes[id(c)] for c in children), 1 << 62)
    return sizes[id(node)]


def _open_regular(path: Path, what: str) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most MAX_CONFIG_BYTES; a FIFO, a device or a folder
    is refused without blocking (a FIFO named as a recipe would hang the reader)."""
    import os
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UsageError(f"{what} {str(path)!r}: no such file") from None
    except OSError as e:
        raise UsageError(f"{what} {str(path)!r} cannot be opened: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{what} {str(path)!r} is not a regular file")
        if info.st_size > MAX_CONFIG_BYTES:
            raise UsageError(f"{what} {path} is {info.st_size:,} bytes; a {what} is a YAML file of at most 1 MiB")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(MAX_CONFIG_BYTES + 1)[:MAX_CONFIG_BYTES]
    finally:
        os.close(fd)


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,99}")


def yaml_mapping_file(path: str | Path, what: str = "recipe") -> dict[str, Any]:
    """A YAML file's mapping; a missing, binary, huge, aliased-without-end or non-mapping file is one UsageError
    naming it (never quoting it: a mistaken ``--config /etc/shadow`` must not print the file)."""
    path = Path(path)
    text = _open_regular(path, what)
    try:
        source = text.decode("utf-8")
        nodes = _expanded_nodes(node) if (node := yaml.compose(source, Loader=yaml.SafeLoader)) is not None else 0
        if nodes > MAX_YAML_NODES:
            raise UsageError(f"{what} {path} expands to {nodes:,} YAML nodes through its aliases (&/*); a {what} "
                             f"has at most {MAX_YAML_NODES:,}")
        data = yaml.safe_load(source)
    except UnicodeDecodeError:
        raise UsageError(f"{what} {path} is not UTF-8 text (a binary file?); give a YAML {what}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UsageError(f"{what} {path} is not valid YAML: {e.problem or e.context}{where}") from None
    except yaml.YAMLError as e:
        raise UsageError(f"{what} {path} is not valid YAML ({type(e).__name__})") from None
    except RecursionError:
        raise UsageError(f"{what} {path} nests too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{what} {path} holds a YAML {type(data).__name__}; a {what} is a mapping of keys")
    for key_node, _ in getattr(node, "value", ()):  # a key no recipe has (a password file's line): never echoed
        if not (isinstance(key_node.value, str) and _KEY.fullmatch(key_node.value)):
            raise UsageError(f"{what} {path} is not a {what}: line {key_node.start_mark.line + 1} holds no key name "
                             "(letters, digits, '_', '.', '-'; the line is not shown)")
    return data


def check_config_files(path: str | Path, what: str = "recipe") -> None:
    """Check ``path`` and every file its ``config:`` key includes (jsonargparse's include, relative to the
    including file) as :func:`yaml_mapping_file` does, before jsonargparse opens any of them."""
    chain: list[Path] = []
    current: Path | None = Path(path)
    while current is not None:
        if len(chain) >= MAX_INCLUDES or current.resolve() in chain:
            raise UsageError(f"{what} {chain[0]}: its config: includes loop or go deeper than {MAX_INCLUDES} files")
        chain.append(current.resolve())
        include = yaml_mapping_file(current, what).get("config")
        names = [include] if isinstance(include, str) else include if isinstance(include, list) else []
        nxt = None
        for name in names:
            if isinstance(name, str):
                here = current.parent / name
                target = here if here.exists() or Path(name).is_absolute() else Path(name)
                if nxt is None:
                    nxt = target
                else:
                    check_config_files(target, what)
        current = nxt


def output_file(path: Path | str, flag: str, suffix: str | None = None, carded: Sequence[str | Path] = ()) -> Path:
    """``path`` checked as a place a command may write its output to, before the command runs (not after an
    hour of evaluation): its folder exists and is writable, it is not a folder, has ``suffix``, and it is not
    inside a mask folder (a mask folder changes only as a whole, through the folder swap: ``--json M/config.json``
    would overwrite the mask's own config), unless that folder is one of ``carded``, whose card update (the
    swap) takes the file in: the caller writes it elsewhere first (:func:`staged`). Raises UsageError naming ``flag``."""
    import os

    from .mask.folder import holds_mask_config

    path = Path(path).expanduser()
    folder = path.parent
    if suffix and path.suffix.lower() != suffix:
        raise UsageError(f"{flag}: {str(path)!r} must end in {suffix}")
    if path.is_dir():
        raise UsageError(f"{flag}: {path} is a folder; give a file name")
    if not folder.is_dir():
        raise UsageError(f"{flag}: cannot write {path}: there is no folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag}: cannot write {path}: permission denied")
    if holds_mask_config(folder) and not any(Path(c).resolve() == folder.resolve() for c in carded):
        raise UsageError(
            f"{flag}: {path} is inside the mask folder {folder}, which leank changes only as a whole; write it "
            "elsewhere (--card copies a plot into the mask's card)"
        )
    return path


@contextmanager
def staged(path: Path | None) -> Iterator[Path | None]:
    """Where to draw the output ``path``: itself, or, when it is inside a mask folder (allowed only for a
    folder whose card takes it, see :func:`output_file`), a file of the same name in a temporary folder that the
    card update copies in through the folder swap."""
    from .mask.folder import holds_mask_config

    if path is None or not holds_mask_config(path.parent):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="leank-staged-") as tmp:
        yield Path(tmp) / path.name


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
    register_type(Fraction, float, _checked(fraction))
    _REGISTERED = True
