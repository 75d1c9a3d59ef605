"""Atomic writes, the one implementation: a folder replaced as a whole (a complete new sibling, then swapped in),
a folder created once (:func:`create_folder`), removed at once (:func:`remove_folder`), a file replaced at once
(:func:`write_file`).

A mask repo (mask, config, card, plot) must change as one: a reader never sees one writer's
``mask.safetensors`` beside another's ``config.json``, a crash never leaves half a folder, and an
export never deletes what is not its own. So :func:`write_folder` fills a fresh temporary sibling
folder, then, holding an exclusive lock on the parent folder (``fcntl.flock``: concurrent writers
take turns), exchanges it with the target in one ``renameat2(RENAME_EXCHANGE)`` where Linux has it
(else two renames) and removes the old one. What may be replaced is decided up front, before
anything is written: only a folder the caller recognises as its own kind (a mask repo) or an empty
one; a file, a symlink, ``/`` or any other folder is refused.

What a killed writer leaves is put right by the next one to take the lock (:func:`tidy`): a new
folder half-filled (``.NAME.new-*``, locked while it is filled, so a live one is never taken) is
removed, and without the exchange, a target moved aside (``.NAME.old-*/x``) when the writer died
between its two renames is put back, so the mask never vanishes into a hidden folder.

Only folders leank can prove it made are touched: each sibling holds a marker file (:data:`MARKER`) naming
the sibling and its inode, written as the sibling is made, beside the content in ``x``. A user's folder that
merely matches ``.NAME.{new,old,gone}-XXXXXXXX`` (or a copy of a leftover: another inode) is never removed,
and never moved into the target's place.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


class FolderError(ValueError):
    """The target of a folder write cannot be replaced safely; the message says why."""


class FolderChanged(FolderError):
    """The folder was replaced or changed after it was read, so a swap would undo that change (a lost update)."""


def refusal(target: Path, problem: Callable[[Path], str | None], kind: str) -> str | None:
    """Why ``target`` may not be replaced by a new ``kind`` folder (None when it may); ``problem(folder)``
    says why a non-empty folder is not of that kind (None when it is)."""
    first = target.parts[0] if target.parts else ""
    try:
        home = first.startswith("~") and Path(first).expanduser() != Path(first)
    except RuntimeError:  # ~name of no user: a shell would not expand it either
        home = False
    if home:
        return (f"{str(target)!r} starts with {first!r}, which only a shell expands to a home folder; leank takes the "
                f"path as written (it would make a folder named {first!r}): give the full path")
    if target.name in ("", ".", "..") or target.resolve() == Path(target.anchor or "/").resolve():
        return f"{str(target)!r} is not a folder name leank can write a {kind} to (give a new or {kind} folder)"
    if target.is_symlink():
        return f"{target} is a symlink; leank does not replace links (remove it or give another folder)"
    if target.exists() and not target.is_dir():
        return f"{target} exists and is not a folder; leank will not replace it with a {kind}"
    why = problem(target) if target.is_dir() and any(target.iterdir()) else None
    if why:
        return (
            f"{target} is a folder that is not a {kind} ({why}); leank replaces only an empty "
            f"folder or an older {kind}: give a new folder name"
        )
    return None


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``folder`` itself (no lock file is left behind), released on exit."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


# a full disk, a quota, a read-only file system, no permission: the target's trouble, said in one line
_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
_SIBLING = re.compile(r"\.(?P<name>.+)\.(?P<kind>new|old|gone)-[A-Za-z0-9_]{8}")


MARKER = ".leank-sibling"  # in each sibling leank makes: "leank KIND NAME INODE", its proof of ownership


def _marker_text(folder: Path, kind: str) -> str:
    return f"leank {kind} {folder.name} {os.lstat(folder).st_ino}\n"


def _own(folder: Path, kind: str) -> bool:
    """Whether ``folder`` is a sibling leank made (its marker names it and its inode; not a link; this user's)."""
    try:
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            return False
        fd = os.open(folder / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            mark = os.fstat(fd)
            text = os.read(fd, 512) if stat.S_ISREG(mark.st_mode) and mark.st_uid == os.geteuid() else b""
        finally:
            os.close(fd)
        return text.decode("utf-8", "replace") == _marker_text(folder, kind)
    except OSError:
        return False


@contextmanager
def _fresh(parent: Path, name: str, kind: str, parent_locked: bool = False) -> Iterator[Path]:
    """A new hidden sibling folder ``.NAME.KIND-XXXXXXXX`` holding its marker (:data:`MARKER`), flock-ed while the
    block runs: :func:`tidy` (under the parent's lock, as the folder is made and locked) takes only unlocked ones
    that it made, whose writer died. The content goes into its ``x``."""

    def make() -> tuple[Path, int]:
        try:
            folder = Path(tempfile.mkdtemp(prefix=f".{name}.{kind}-", dir=parent))
        except OSError as e:
            if e.errno not in _WRITE_ERRORS:
                raise
            raise FolderError(f"cannot write {parent / name}: {e.strerror} in {parent} (nothing was changed)") from None
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            (folder / MARKER).write_text(_marker_text(folder, kind))
        except BaseException as e:
            os.close(fd)
            shutil.rmtree(folder, ignore_errors=True)
            if isinstance(e, OSError) and e.errno in _WRITE_ERRORS:
                raise FolderError(f"cannot write {parent / name}: {e.strerror} (nothing was changed)") from None
            raise
        return folder, fd

    if parent_locked:
        folder, fd = make()
    else:
        with _locked(parent):
            folder, fd = make()
    try:
        yield folder
    finally:
        os.close(fd)


def _held(folder: Path) -> bool:
    """Whether a live process holds ``folder``'s flock (it is still being filled)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def tidy(target: Path) -> None:
    """Put right what killed writers of ``target`` left beside it; call it holding the parent's lock.

    A target moved aside (``.NAME.old-*/x``) while the target is missing is put back (the newest); other
    ``.NAME.old-*`` and ``.NAME.gone-*`` folders, and ``.NAME.new-*`` folders no live writer holds, are removed:
    only those leank made (their marker, :func:`_own`), never a user's folder of such a name.
    """
    parent = target.parent
    try:
        entries = [(m.group("kind"), parent / n) for n in os.listdir(parent)
                   if (m := _SIBLING.fullmatch(n)) and m.group("name") == target.name]
    except OSError:
        return
    entries = [(kind, p) for kind, p in entries if _own(p, kind)]
    aside = sorted((p for kind, p in entries if kind == "old" and (p / "x").is_dir()),
                   key=lambda p: p.stat().st_mtime_ns, reverse=True)
    if aside and not os.path.lexists(target):
        try:
            os.rename(aside[0] / "x", target)
        except OSError:
            pass
    for kind, p in entries:
        if kind == "new" and _held(p):
            continue
        shutil.rmtree(p, ignore_errors=True)


def recover_folder(target: str | os.PathLike) -> None:
    """Put back ``target`` if a writer died between the two renames of a swap (see :func:`tidy`)."""
    target = Path(target)
    if target.parent.is_dir():
        try:
            with _locked(target.parent):
                tidy(target)
        except OSError:
            pass


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2``); False where the system or file system cannot."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _ordinary_permissions(folder: Path) -> None:
    """mkdtemp makes a private (0700) folder: give it and its files the umask's usual permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        if f.is_file() and not f.is_symlink():
            os.chmod(f, 0o666 & ~umask)


def generation(folder: Path) -> tuple:
    """A stamp of what ``folder`` is now: its identity (a swap makes another folder) and each entry's name,
    identity, size and change time (an edit in place). Two reads of the same version give the same stamp."""
    info = os.stat(folder)
    entries = []
    for name in sorted(os.listdir(folder)):
        try:
            e = os.lstat(folder / name)
        except FileNotFoundError:
            continue
        entries.append((name, e.st_ino, e.st_size, e.st_mtime_ns, e.st_ctime_ns))
    return (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_ctime_ns, tuple(entries))


def update_folder(
    target: str | os.PathLike,
    fill: Callable[[Path], None],
    problem: Callable[[Path], str | None],
    kind: str,
    attempts: int = 5,
) -> Path:
    """Read-modify-write of the existing folder ``target``: ``fill(tmp)`` reads ``target`` and writes its new
    content, which replaces it in one swap only if ``target`` is still the version ``fill`` read.

    If another writer replaced or changed it meanwhile (an export or a save while a card was drawn), the
    swap is not made (it would undo that write) and ``fill`` runs again on the new version, up to
    ``attempts`` times; then :class:`FolderChanged`. The folder is held open while it is read, so its
    identity cannot be reused by a newer folder in between.
    """
    target = Path(target)
    for _ in range(attempts):
        try:
            held = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise FolderError(f"{target} cannot be opened to update it: {e.strerror}") from None
        try:
            with _locked(target.parent):  # not halfway through another writer's swap
                stamp = generation(target)
            try:
                return write_folder(target, fill, problem, kind, expected=stamp)
            except FolderChanged:
                continue
        finally:
            os.close(held)
    raise FolderChanged(f"{target} kept changing while it was being updated ({attempts} tries); try again")


def write_folder(
    target: str | os.PathLike,
    fill: Callable[[Path], None],
    problem: Callable[[Path], str | None],
    kind: str,
    expected: tuple | None = None,
) -> Path:
    """Make ``target`` a folder holding exactly what ``fill(tmp)`` writes into a fresh folder, in one swap.

    Raises :class:`FolderError` (nothing written) when ``target`` is a file, a symlink, ``/``, or a
    non-empty folder for which ``problem`` gives a reason. If ``fill`` fails, the target is untouched
    and the temporary folder is removed. ``expected``: the :func:`generation` the target must still have
    at the swap (else :class:`FolderChanged`, nothing replaced); see :func:`update_folder`.
    """
    target = Path(target)
    if target.parent.is_dir():
        with _locked(target.parent):  # not halfway through another writer's swap; put right what a killed one left
            tidy(target)
            why = refusal(target, problem, kind)
    else:
        why = refusal(target, problem, kind)
    if why:
        raise FolderError(why)
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FolderError(f"cannot make the folder {parent} to hold {target.name}: {e.strerror}") from None
    with _fresh(parent, target.name, "new") as box:
        tmp = box / "x"
        try:
            try:
                tmp.mkdir()
                fill(tmp)
                _ordinary_permissions(tmp)
            except OSError as e:
                if e.errno not in _WRITE_ERRORS:
                    raise
                raise FolderError(f"cannot write {target}: {e.strerror} (nothing was changed)") from None
            with _locked(parent):
                why = refusal(target, problem, kind)  # again: it may have changed while we wrote
                if why:
                    raise FolderError(why)
                if expected is not None and (not target.is_dir() or generation(target) != expected):
                    raise FolderChanged(f"{target} changed after it was read; the update was not swapped in")
                if target.is_dir() and _exchange(tmp, target):
                    pass  # tmp now holds the old folder
                elif target.is_dir():
                    _swap_by_renames(tmp, target)
                else:
                    os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(box, ignore_errors=True)
            raise
        shutil.rmtree(box, ignore_errors=True)  # the old folder
    return target


def _swap_by_renames(new: Path, target: Path) -> None:
    """No atomic exchange here: move the old folder aside, then the new one in; put the old one back if that
    fails. A crash between the two renames leaves the old one in ``.NAME.old-*/x``, which :func:`tidy` puts back."""
    with _fresh(target.parent, target.name, "old", parent_locked=True) as old:
        os.rename(target, old / "x")
        try:
            os.rename(new, target)
        except BaseException:
            os.rename(old / "x", target)  # if this fails too, old/x stays where tidy() finds it
            shutil.rmtree(old, ignore_errors=True)
            raise
        shutil.rmtree(old, ignore_errors=True)


def create_folder(target: str | os.PathLike, fill: Callable[[Path], None]) -> Path:
    """Make ``target`` what ``fill(tmp)`` writes into a fresh sibling, renamed into place, unless another
    process made it first (its folder is kept, ours dropped): a cache entry built once, never seen half-written.

    If ``fill`` fails, nothing is left behind; what a killed builder left is removed first (:func:`tidy`).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent):
        tidy(target)
    with _fresh(target.parent, target.name, "new") as box:
        tmp = box / "x"
        try:
            tmp.mkdir()
            fill(tmp)
            _ordinary_permissions(tmp)
            try:
                os.rename(tmp, target)
            except OSError:  # another process won the race: use its folder
                pass
        finally:
            shutil.rmtree(box, ignore_errors=True)
    return target


def remove_folder(target: str | os.PathLike) -> None:
    """Take ``target`` away at once (renamed aside, then deleted): no reader sees it half-deleted.

    A folder another process removed or moved first is not an error.
    """
    target = Path(target)
    with _fresh(target.parent, target.name, "gone") as aside:
        try:
            os.rename(target, aside / "x")
        except OSError:
            pass
        shutil.rmtree(aside, ignore_errors=True)


def write_file(path: str | os.PathLike, data: str | bytes) -> Path:
    """Replace the file ``path`` with ``data`` at once (a sibling written, then ``os.replace``d): a reader
    sees the old content or the new, a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
