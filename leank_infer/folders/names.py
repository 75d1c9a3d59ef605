"""What a Hub repo id, a revision and a file inside a repo may be, checked before any file is touched.

A mask comes from strangers, and its ``base_revision`` / ``adapter_revision`` reach
huggingface_hub, which (offline) turns a revision into a path in the Hub cache: ``../..`` would
walk out of it. Repo ids follow huggingface_hub's own ``validate_repo_id``; revisions (which
huggingface_hub does not check) follow git's ref-name rules: a branch, a tag or a commit id.
"""

from __future__ import annotations

import re
from typing import Any

MAX_REVISION = 255  # git and the Hub refuse longer ref names
MAX_REPO_ID = 96 * 2 + 1  # owner and name: 96 characters each (huggingface_hub's validate_repo_id)
MAX_LOCAL_PATH = 4096  # PATH_MAX: a longer name is neither a folder nor a repo id
# one ref-name component: no control chars, space, ~ ^ : ? * [ \ (git check-ref-format), not starting with '.'
_COMPONENT = re.compile(r"[^\x00-\x20\x7f~^:?*\[\\./][^\x00-\x20\x7f~^:?*\[\\/]*")


def revision_problem(revision: Any) -> str | None:
    """Why ``revision`` is not a branch, tag or commit id (None when it is one)."""
    if not isinstance(revision, str):
        return f"a revision must be a string, got {type(revision).__name__}"
    if not revision or len(revision) > MAX_REVISION:
        return f"a revision is 1 to {MAX_REVISION} characters long, got {len(revision)}"
    if ".." in revision or "@{" in revision or revision == "@":
        return f"revision {revision!r} contains '..' or '@{{' (not a branch, tag or commit id)"
    parts = revision.split("/")
    for part in parts:
        if not _COMPONENT.fullmatch(part) or part.endswith((".lock", ".")):
            return (
                f"revision {revision!r} is not a branch, tag or commit id (git ref-name rules: no empty or "
                "'.'-leading parts, no spaces, control characters, ~ ^ : ? * [ \\, no trailing '.' or '.lock')"
            )
    return None


def control_characters(text: str) -> bool:
    """Whether ``text`` holds control characters (terminal escape sequences among them): no path or Hub id
    does, and a stranger's mask must not write them to a terminal."""
    return any(ord(c) < 32 or 127 <= ord(c) < 160 for c in text)


def repo_id_problem(repo_id: Any) -> str | None:
    """Why ``repo_id`` is not a Hub repo id ``owner/name`` (huggingface_hub's own rules); None when it is one."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(repo_id, str) or not repo_id.strip():
        return f"a Hub repo id is a non-empty string (owner/name), got {repo_id!r}"
    if len(repo_id) > MAX_REPO_ID:
        return f"a Hub repo id is at most {MAX_REPO_ID} characters (owner/name), got {len(repo_id)}"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        return str(e).strip().splitlines()[0]
    return None


def inner_file_problem(name: Any) -> str | None:
    """Why ``name`` is not a relative path to a file inside a folder or repo (None when it is one).

    A mask's loader hints (``gguf_file``) name a file of the base model's folder or package: an
    absolute path or ``..`` would make a stranger's mask open any file on this machine.
    """
    if not isinstance(name, str) or not name or len(name) > MAX_REVISION:
        return f"must be a file name of 1 to {MAX_REVISION} characters, got {name!r}"[:200]
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or "\x00" in name or any(p in ("", ".", "..") for p in parts):
        return f"{name!r} must name a file inside the model's folder or package (a relative path without '..')"
    if any(c in name for c in "*?[]") or any(ord(c) < 32 or ord(c) == 127 for c in name):
        return f"{name!r} must name one file (no glob characters * ? [ ], no control characters)"
    return None
