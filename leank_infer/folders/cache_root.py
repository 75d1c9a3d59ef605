"""Where leank keeps what it builds once per machine (the de-quantised embedded model, compiled kernels).

``$LEANK_CACHE`` when set, else ``~/.cache/leank``: one function decides, for every user of the cache,
and a value that cannot work is one clear error here, not a traceback deep inside a writer (a file
named by the variable, a read-only folder) or a silent surprise (a relative value wrote 540 MB into
whatever folder leank was started from). An empty value counts as unset, as XDG's variables do.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "LEANK_CACHE"


class CacheRootError(ValueError):
    """The cache folder cannot be used; the message names the variable and says why."""


def cache_root(writable: bool = True) -> Path:
    """The cache folder: ``$LEANK_CACHE`` (``~`` expanded; it must be absolute) or ``~/.cache/leank``, made if
    missing, and (``writable``) checked to be one this process can write into; ``writable=False`` for a
    reader of what is already there (a read-only cache prepared for it)."""
    value = os.environ.get(ENV, "").strip()
    source = f"{ENV}={value!r}" if value else "the default cache folder ~/.cache/leank"
    try:
        root = Path(value).expanduser() if value else Path.home() / ".cache" / "leank"
    except RuntimeError as e:  # no home folder to expand ~ against
        raise CacheRootError(f"{source}: {e}; set {ENV} to an absolute folder") from None
    if not root.is_absolute():
        raise CacheRootError(f"{source} is a relative path; give an absolute folder (it would land in whatever "
                             "folder leank runs from)")
    if root.exists() and not root.is_dir():
        raise CacheRootError(f"{source}: {root} exists and is not a folder; give a folder leank may write into")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheRootError(f"{source}: cannot make the folder {root}: {e.strerror}; give a folder leank may "
                             "write into") from None
    if writable and not os.access(root, os.W_OK | os.X_OK):
        raise CacheRootError(f"{source}: {root} is read-only for this user; give a folder leank may write into")
    return root
