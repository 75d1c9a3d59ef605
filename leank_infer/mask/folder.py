"""A mask folder on disk: read its two files safely (bounded, one version of the folder), write it whole.

Writes go through :func:`leank_infer.folders.atomic.write_folder` (a new sibling swapped in under a
lock); reads hold one handle on the folder, so a concurrent writer's swap is seen whole, old or new.
"""

from __future__ import annotations

import fnmatch
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import torch

from ..folders.atomic import FolderError, recover_folder, refusal, update_folder, write_folder
from .format import (
    ALLOW_PATTERNS,
    CONFIG_FILE,
    MASK_FILE,
    MAX_CONFIG_BYTES,
    MAX_JSON_DEPTH,
    MAX_MASK_BYTES,
    MAX_REPO_BYTES,
    MAX_REPO_FILES,
    READ_VERSIONS,
    REQUIRED_KEYS,
    MaskError,
    file_limit,
)


def mask_repo_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a mask repo leank may replace (None when it is one).

    A mask repo is recognised by its content: a ``config.json`` that parses as a leank mask config
    (a format version leank reads, the required keys), beside nothing but a mask repo's own files
    (mask, card, eval.json, plots, LICENSE), none of them a link. A user's folder with some other
    ``config.json``, or a ``mask.safetensors`` among photos, is not one (``mask.safetensors`` itself may be
    missing or damaged: a repo whose config says it is a mask repo may be replaced whole).
    """
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        return f"it cannot be listed: {e.strerror}"
    others = [n for n in names if not any(fnmatch.fnmatch(n, pat) for pat in ALLOW_PATTERNS)]
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        return f"it holds other files: {shown}"
    if CONFIG_FILE not in names:
        return f"it has no {CONFIG_FILE} (a mask repo is recognised by its leank {CONFIG_FILE})"
    path = folder / CONFIG_FILE
    try:
        odd = [n for n in names if not stat.S_ISREG(os.lstat(folder / n).st_mode)]
        if odd:
            return f"{', '.join(odd[:3])} {'is' if len(odd) == 1 else 'are'} not a regular file"
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            check_config_header(parse_config(_read_limited(dir_fd, folder, CONFIG_FILE, MAX_CONFIG_BYTES, False), path),
                                path)
        finally:
            os.close(dir_fd)
    except (OSError, _Vanished):
        return "it changed while it was read"
    except MaskError as e:
        return f"its {CONFIG_FILE} is not a leank mask config: {str(e).replace(str(path), '').strip(' :')}"
    return None


def holds_mask_config(folder: Path) -> bool:
    """Whether ``folder`` holds a ``config.json`` that parses as a leank mask config: a mask folder (whole or
    damaged, replaceable or not), into which nothing is written but through the folder swap."""
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        path = folder / CONFIG_FILE
        check_config_header(parse_config(_read_limited(dir_fd, folder, CONFIG_FILE, MAX_CONFIG_BYTES), path), path)
        return True
    except (MaskError, _Vanished):
        return False
    finally:
        os.close(dir_fd)


def is_mask_repo(folder: Path) -> bool:
    """Whether ``folder`` is a mask repo leank may replace (see :func:`mask_repo_problem`)."""
    return mask_repo_problem(folder) is None


def check_mask_target(target: str | os.PathLike) -> None:
    """Raise MaskError unless ``target`` is a place a mask repo may be written (new, empty, or a mask repo)."""
    why = refusal(Path(target), mask_repo_problem, "mask repo")
    if why:
        raise MaskError(why)


def write_mask_folder(target: str | os.PathLike, fill: Any) -> Path:
    """Make ``target`` exactly what ``fill(tmp)`` writes (mask files, card, plot), swapped in as a whole.

    Only a new or empty folder or an older mask repo is replaced; a file, a symlink, ``/`` or a
    folder with other files is refused up front (MaskError, nothing written). Concurrent writers
    take turns; readers see the old folder or the new one. See :mod:`leank_infer.folders.atomic`.
    """
    try:
        return write_folder(target, fill, mask_repo_problem, "mask repo")
    except FolderError as e:
        raise MaskError(str(e)) from None


def update_mask_folder(target: str | os.PathLike, fill: Any) -> Path:
    """Rewrite the mask repo ``target`` from itself: ``fill(tmp)`` reads ``target`` and writes the new folder,
    swapped in only if ``target`` did not change meanwhile (else ``fill`` runs again on the new version), so
    an export or save made while, say, a card was drawn is never undone. See :func:`update_folder`."""
    try:
        return update_folder(target, fill, mask_repo_problem, "mask repo")
    except FolderError as e:
        raise MaskError(str(e)) from None


class _Vanished(Exception):
    """A file disappeared while reading (the folder was being swapped, or it is missing)."""


def _read_limited(dir_fd: int, folder: Path, name: str, limit: int, follow: bool = True,
                  one_link: bool = False) -> bytes:
    """The bytes of regular file ``name`` in the folder open as ``dir_fd``, at most ``limit`` of them
    (``follow=False``: a symlink is refused, not followed; ``one_link``: a file with other hard links is refused)."""
    path = folder / name
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)  # a FIFO must not block
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise _Vanished(name) from None
    except OSError as e:
        if not follow and stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode):
            raise MaskError(f"{path} is a symlink; only regular files inside the folder are read from it, "
                            "never what a link points to") from None
        raise MaskError(f"{path} cannot be opened: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = ("folder" if stat.S_ISDIR(info.st_mode) else "pipe (FIFO)" if stat.S_ISFIFO(info.st_mode)
                    else "device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) else "socket or other")
            raise MaskError(f"{path} is a {kind}, not a regular file; a mask folder holds plain files only")
        if one_link and info.st_nlink != 1:
            raise MaskError(f"{path} has {info.st_nlink} hard links; leank publishes only files with one link "
                            "(a hard link may be another file of yours, e.g. credentials): copy it in instead")
        if info.st_size > limit:
            raise MaskError(f"{path} is {info.st_size:,} bytes; a mask's {name} may hold at most {limit:,}")
        chunks, size = [], 0
        try:
            while chunk := os.read(fd, min(1 << 20, limit + 1 - size)):
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise MaskError(f"{path} holds more than {limit:,} bytes, the most a mask's {name} may hold")
        except OSError as e:  # /proc/self/mem, a file on a failing disk: not a mask file
            raise MaskError(f"{path} cannot be read ({e.strerror}); a mask folder holds plain files only") from None
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_repo_files(folder: str | os.PathLike) -> dict[str, bytes]:
    """The files of the mask repo ``folder`` that are published (:data:`ALLOW_PATTERNS`, by name), each read as
    a regular file inside the folder, bounded (:func:`file_limit`).

    A link among them is refused, not followed: a README.md linked to ``~/.aws/credentials`` would
    otherwise be published as the card. So is a hard link (a file with more than one name: the same
    credentials under another name), a FIFO, a device or a folder of such a name.
    """
    folder = Path(folder)
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise MaskError(f"{folder} is not a folder that can be read: {e.strerror}") from None
    try:
        names = sorted(n for n in os.listdir(dir_fd) if any(fnmatch.fnmatch(n, pat) for pat in ALLOW_PATTERNS))
        if len(names) > MAX_REPO_FILES:
            raise MaskError(f"{folder} holds {len(names)} mask repo files; a mask repo has at most {MAX_REPO_FILES}")
        files: dict[str, bytes] = {}
        for name in names:
            try:
                files[name] = _read_limited(dir_fd, folder, name, file_limit(name), follow=False, one_link=True)
            except _Vanished:
                raise MaskError(f"{folder / name} disappeared while it was read; try again") from None
        total = sum(map(len, files.values()))
        if total > MAX_REPO_BYTES:
            raise MaskError(f"{folder}'s mask repo files hold {total:,} bytes together; at most {MAX_REPO_BYTES:,}")
        return files
    finally:
        os.close(dir_fd)


def read_mask_files(folder: Path) -> tuple[bytes, bytes]:
    """(config.json, mask.safetensors) bytes, both from one version of ``folder`` (retried if it was swapped)."""
    for attempt in range(20):
        try:
            dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if attempt < 3:  # a writer without an atomic exchange moves the old folder aside for a moment
                time.sleep(0.01)
                continue
            if attempt == 3:  # or died between its two renames: the folder is put back from where it was moved
                recover_folder(folder)
                continue
            raise MaskError(f"mask folder {folder} does not exist") from None
        except NotADirectoryError:
            raise MaskError(f"{folder} is not a folder") from None
        except OSError as e:
            raise MaskError(f"mask folder {folder} cannot be opened: {e.strerror}") from None
        try:
            return (
                _read_limited(dir_fd, folder, CONFIG_FILE, MAX_CONFIG_BYTES),
                _read_limited(dir_fd, folder, MASK_FILE, MAX_MASK_BYTES),
            )
        except _Vanished as e:
            if not _swapped(folder, dir_fd):
                where = folder if folder.is_absolute() else f"{folder} (that is {folder.absolute()})"
                raise MaskError(f"{e} is missing in {where}") from None
        finally:
            os.close(dir_fd)
    raise MaskError(f"mask folder {folder} kept changing while it was read; try again")


def _swapped(folder: Path, dir_fd: int) -> bool:
    """Whether ``folder`` now names another folder than the one open as ``dir_fd`` (a writer replaced it)."""
    held = os.fstat(dir_fd)
    try:
        now = os.stat(folder)
    except OSError:
        return True
    return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)


def _json_depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            depth = max(depth, d)
            if d <= MAX_JSON_DEPTH:
                stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return depth


def parse_config(data: bytes, path: Path) -> dict[str, Any]:
    """``config.json`` as a dict; anything else (bad UTF-8 or JSON, too deep, huge numbers) is one MaskError."""
    try:
        cfg = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise MaskError(f"{path} is not UTF-8 text: {e}") from None
    except RecursionError:
        raise MaskError(f"{path} nests JSON too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError as e:  # JSONDecodeError, and integers too long to convert
        raise MaskError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise MaskError(f"{path} must hold a JSON object")
    if _json_depth(cfg) > MAX_JSON_DEPTH:
        raise MaskError(f"{path} nests JSON too deeply (at most {MAX_JSON_DEPTH} levels)")
    return cfg


def check_config_header(cfg: dict[str, Any], path: Path) -> None:
    """Raise MaskError unless ``cfg`` (a parsed config.json) is a leank mask config this leank reads:
    a known ``format_version`` and every required key."""
    version = cfg.get("format_version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise MaskError(f"{path}: unknown format_version {version!r} (this leank reads versions {READ_VERSIONS})")
    missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if missing:
        raise MaskError(f"{path} lacks required keys: {', '.join(missing)}")


def read_safetensors(data: bytes, path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise MaskError(f"{path} is damaged or truncated and cannot be read as safetensors: {e}") from None
