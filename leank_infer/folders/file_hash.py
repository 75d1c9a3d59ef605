"""The SHA-256 of a file, read in blocks: how leank checks what it cached (de-quantised model copies, compiled
kernels) is what it wrote, whatever the file's size."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of the whole file at ``path`` (4 MiB blocks: memory stays flat on multi-GB weights)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()
