"""The project's C++ CPU kernels as shared libraries: compiled once into the cache, loaded with ctypes.

One :class:`NativeLibrary` per kernel source (:mod:`leank_infer.decode.quant_cpu`,
:mod:`leank_infer.vllm.cpu_decode`; that module's docstring says why ctypes and not a PyTorch extension or
numba). The first :meth:`NativeLibrary.available` compiles the source with the system C++ compiler
(``$CXX``, else ``c++``, ``g++``, ``clang++``) into ``~/.cache/leank/<folder>/`` (or ``$LEANK_CACHE``), the
file named by a hash of the source, the flags, the compiler and the CPU (``-march=native`` code may not run on
another CPU of a shared home); later processes load it in milliseconds. The flags are tried in order
(:data:`TRIES`), the first that builds wins. Where no compiler works, or the kernel's environment switch is
``0``, ``available()`` is false and the caller keeps its PyTorch path (logged once).

Loading a library runs its code, so a cached one is loaded only once it is verified (:func:`library_problem`):
a regular file (not a link) owned by this user and writable by no one else, in a folder that no other user can
write to (nor any folder above it, unless sticky like ``/tmp``), whose SHA-256 is the one the build recorded
beside it (``NAME.so.sha256``, written atomically before the library is renamed into place). A library planted
under the expected name, a link to one, a truncated or damaged file, or one without its record is rebuilt (one
log line), never loaded; a kernel folder other users may write to is refused (the PyTorch path is used).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..folders.file_hash import file_sha256

# No -ffast-math: it would let the compiler assume no NaN (the tests' NaN pages catch stray reads) and, in a
# shared library built by GCC < 13, switch the whole process to flush-to-zero.
FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast", "-shared", "-fPIC"]
TRIES = (
    ["-march=native", "-fopenmp"],
    ["-fopenmp"],
    [],
)  # first that builds wins; the last is single-threaded


def cpu_id() -> str:
    """What ``-march=native`` depends on: a library built on another CPU (a shared home) may not run here."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "Features", "model name", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


RECORD_SUFFIX = ".sha256"  # NAME.so.sha256 beside NAME.so: the library's SHA-256 as the build wrote it


_sha256 = file_sha256  # module-level name: tests patch it to count the files hashed


def folder_problem(directory: Path) -> str | None:
    """Why libraries in ``directory`` cannot be trusted (None when they can): the folder must be this user's
    and writable by no one else, and every folder above it owned by this user or root and, if others may write
    to it, sticky (``/tmp``): otherwise another user could swap the library or the folder holding it."""
    uid = os.geteuid()
    try:
        info = os.lstat(directory)
    except OSError as e:
        return f"{directory} cannot be inspected: {e.strerror}"
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        return f"{directory} is not a folder (a link or a file)"
    if info.st_uid != uid:
        return f"the kernel folder {directory} belongs to another user (uid {info.st_uid})"
    if info.st_mode & 0o022:
        return f"the kernel folder {directory} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    for above in directory.resolve().parents:
        try:
            up = os.stat(above)
        except OSError as e:
            return f"{above} cannot be inspected: {e.strerror}"
        if up.st_uid not in (0, uid):
            return f"{above}, above the kernel folder, belongs to another user (uid {up.st_uid})"
        if up.st_mode & 0o022 and not up.st_mode & stat.S_ISVTX:
            return f"{above}, above the kernel folder, is writable by other users and not sticky"
    return None


def library_problem(lib_path: Path) -> str | None:
    """Why the cached library ``lib_path`` may not be loaded (None when it is verified; see the module
    docstring): its folder, its kind, owner and mode, and its SHA-256 against the build's record."""
    why = folder_problem(lib_path.parent)
    if why:
        return why
    record = lib_path.with_name(lib_path.name + RECORD_SUFFIX)
    uid = os.geteuid()
    for path in (lib_path, record):
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return f"{path.name} is missing" + (" (no hash recorded at build)" if path == record else "")
        except OSError as e:
            return f"{path.name} cannot be inspected: {e.strerror}"
        if stat.S_ISLNK(info.st_mode):
            return f"{path.name} is a symlink"
        if not stat.S_ISREG(info.st_mode):
            return f"{path.name} is not a regular file"
        if info.st_uid != uid:
            return f"{path.name} belongs to another user (uid {info.st_uid})"
        if info.st_mode & 0o022:
            return f"{path.name} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    try:
        want = record.read_text().strip()
        have = _sha256(lib_path)
    except (OSError, UnicodeDecodeError) as e:
        return f"{lib_path.name} cannot be read: {e}"
    if have != want:
        return f"{lib_path.name} does not hash to what its build recorded (damaged, truncated or replaced)"
    return None


class NativeLibrary:
    """One C++ source built into a shared library on first use (see the module docstring).

    ``declare`` sets the ctypes signatures of the loaded library; ``what`` names the kernel in messages;
    ``log`` is the logger of the module that uses it (its warning says the kernel is off, once)."""

    def __init__(
        self,
        source: Path,
        folder: str,
        env_switch: str,
        what: str,
        declare: Callable[[ctypes.CDLL], None],
        log: logging.Logger,
    ):
        self.source, self.folder, self.env_switch, self.what = source, folder, env_switch, what
        self.declare, self.log = declare, log
        self.lib: ctypes.CDLL | None = None
        self.tried = False

    def build(self, extra: list[str] | None = None, directory: Path | None = None) -> Path:
        """Compile the source (or reuse the cached build) and return the library's path; raises on failure.

        ``extra`` flags (e.g. ``-fsanitize=address``) are tried alone, without the fallbacks."""
        cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
        if cxx is None:
            raise OSError("no C++ compiler found (set $CXX)")
        source = self.source.read_text()
        if directory is None:
            from ..folders.cache_root import cache_root

            directory = cache_root() / self.folder
        directory.mkdir(parents=True, exist_ok=True, mode=0o755)
        why = folder_problem(directory)
        if why:
            raise OSError(f"{why}; leank loads kernels only from a folder no other user can write to "
                          "(set $LEANK_CACHE to a private folder)")
        errors = []
        for flags in [extra] if extra is not None else TRIES:
            every = FLAGS + flags
            key = hashlib.sha256("\0".join([source, *every, cxx, cpu_id()]).encode()).hexdigest()[:16]
            lib_path = directory / f"leank_{self.source.stem}_{key}.so"
            if os.path.lexists(lib_path):
                why = library_problem(lib_path)
                if why is None:
                    return lib_path
                self.log.warning("LeanK: the cached %s %s is not verified (%s); rebuilding it", self.what, lib_path, why)
            with tempfile.TemporaryDirectory(dir=directory) as tmp:
                src = Path(tmp) / self.source.name
                src.write_text(source)
                so = Path(tmp) / lib_path.name
                run = subprocess.run([cxx, *every, "-o", str(so), str(src)], capture_output=True, text=True)
                if run.returncode == 0:
                    os.chmod(so, 0o755)
                    digest = Path(tmp) / (lib_path.name + RECORD_SUFFIX)
                    digest.write_text(_sha256(so) + "\n")
                    os.chmod(digest, 0o644)
                    # each rename is atomic: a concurrent builder never loads half a file, and a library whose
                    # record is another build's fails the hash check and is rebuilt, never loaded
                    os.replace(digest, lib_path.with_name(digest.name))
                    os.replace(so, lib_path)
                    return lib_path
                errors.append(f"{' '.join(every)}: {run.stderr[-1500:]}")
        raise OSError(f"building the LeanK {self.what} failed:\n" + "\n".join(errors))

    def use(self, lib: ctypes.CDLL) -> None:
        """Load ``lib`` (a library built from this source, e.g. with sanitiser flags) in place of the cached build."""
        self.declare(lib)
        self.lib, self.tried = lib, True

    def _load(self) -> ctypes.CDLL | None:
        from ..folders.cache_root import CacheRootError

        try:
            lib = ctypes.CDLL(str(self.build()))
        except (OSError, subprocess.SubprocessError, CacheRootError) as e:
            self.log.warning("LeanK: the %s is not available (%s); the PyTorch path is used", self.what, e)
            return None
        self.declare(lib)
        return lib

    def available(self) -> bool:
        """Whether the library is built and switched on (its environment switch not ``0``); the first call builds it."""
        if os.environ.get(self.env_switch, "1") == "0":
            return False
        if not self.tried:
            self.tried = True
            self.lib = self._load()
        return self.lib is not None
