"""Haystacks: the long texts needles hide in, and the key words and sentence split the tasks draw on.

``"noise"`` (a repeated filler paragraph), ``"essay"`` (English prose shipping with Python,
``pydoc_data.topics``; no download), a local text file or folder of ``*.txt``, or any Hub dataset id
with a ``text`` column (``datasets.load_dataset``, the user's network).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from ..errors import RecipeError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_WORDS = (
    "amber anchor apple arrow autumn badger bamboo beacon birch blossom breeze candle canyon cedar cherry "
    "cobalt comet copper coral cricket crystal daisy dawn delta desert dolphin dragon eagle ember falcon "
    "fern fjord forest garnet glacier granite harbor hazel heron island ivory jasmine juniper lagoon lantern "
    "lemon lilac lotus maple marble meadow mercury meteor mint nebula nectar oasis ocean olive onyx orchid "
    "otter panda pearl pepper pine planet plum prairie quartz raven reef river robin saffron sapphire "
    "shadow silver spruce summit swan thistle thunder tiger topaz tulip valley velvet violet walnut willow"
).split()
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")


def essay_text() -> str:
    """English prose from the Python docs shipped with CPython (``pydoc_data.topics``), code blocks dropped."""
    from pydoc_data.topics import topics

    paragraphs = []
    for text in topics.values():
        for para in re.split(r"\n\s*\n", text):
            lines = para.splitlines()
            if not lines or any(line.startswith((" ", "\t")) for line in lines):
                continue  # indented: code, grammar or a table
            joined = " ".join(line.strip() for line in lines)
            letters = sum(c.isalpha() or c == " " for c in joined)
            if len(joined) > 80 and letters / len(joined) > 0.85 and joined.endswith("."):
                paragraphs.append(joined)
    return " ".join(paragraphs)


def haystack_text(spec: str, max_chars: int = 2_000_000) -> str:
    """The text of a haystack named by ``spec`` ("noise", "essay", a local path, or a Hub dataset id)."""
    if spec == "noise":
        return " ".join([NOISE] * 50)
    if spec == "essay":
        return essay_text()
    path = Path(spec).expanduser()
    if path.exists():
        return local_text(path, max_chars)
    if _looks_like_path(spec):
        raise RecipeError(f"haystack {spec!r}: no such file or folder (data.haystacks)")
    from datasets import load_dataset

    try:
        ds = load_dataset(spec, split="train", streaming=True)
    except Exception as e:  # noqa: BLE001 - the Hub/network/format errors of `datasets` are many
        raise RecipeError(
            f"haystack {spec!r} is not a local file or folder, and loading it as a Hub dataset failed: "
            f"{type(e).__name__}: {e}"
        ) from None
    parts, size = [], 0
    for row in ds:
        text = row.get("text")
        if not isinstance(text, str):
            raise ValueError(f"haystack dataset {spec!r} has no string column 'text'")
        parts.append(text)
        size += len(text)
        if size >= max_chars:
            break
    return " ".join(parts)[:max_chars]


MAX_FOLDER_FILES = 10_000  # *.txt files of one haystack folder (its own, not its subfolders')


def _read_regular(path: Path, limit: int) -> str:
    """At most ``limit`` characters of the regular file ``path``: a FIFO, a device (``/dev/zero``) or a socket is
    refused without blocking, and a huge file is read only as far as the haystack needs."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise RecipeError(f"haystack {path} cannot be opened: {e.strerror} (data.haystacks)") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RecipeError(f"haystack {path} is not a regular file (a pipe or device cannot be a haystack; "
                              "data.haystacks)")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(4 * limit).decode("utf-8", errors="replace")[:limit]  # UTF-8: at most 4 bytes a character
    except OSError as e:
        raise RecipeError(f"haystack {path} cannot be read: {e.strerror} (data.haystacks)") from None
    finally:
        os.close(fd)


def local_text(path: Path, max_chars: int) -> str:
    """A local haystack: a text file, or the ``*.txt`` files directly inside a folder (not its subfolders:
    ``/`` must not walk the file system), read until ``max_chars`` characters are there."""
    if not path.is_dir():
        return _read_regular(path, max_chars)
    files = []
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name.endswith(".txt"):
                files.append(Path(entry.path))
                if len(files) > MAX_FOLDER_FILES:
                    raise RecipeError(f"haystack folder {path} holds more than {MAX_FOLDER_FILES:,} *.txt files")
    if not files:
        raise RecipeError(f"haystack folder {path} holds no *.txt file (its subfolders are not read)")
    parts, size = [], 0
    for f in sorted(files):
        parts.append(_read_regular(f, max_chars - size))
        size += len(parts[-1]) + 1
        if size >= max_chars:
            break
    return " ".join(parts)[:max_chars]


def _looks_like_path(spec: str) -> bool:
    """Whether a haystack name can only mean a local path (a Hub id is ``name`` or ``owner/name``)."""
    return (
        spec.startswith(("/", ".", "~", "\\"))
        or spec.count("/") > 1
        or Path(spec).suffix.lower() in (".txt", ".md", ".json", ".jsonl", ".csv", ".parquet")
    )
