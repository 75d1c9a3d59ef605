"""The project's C++ CPU kernels as shared libraries: compiled once into the cache, loaded with ctypes.

One :class:`NativeLibrary` per kernel source (:mod:`leank_infer.decode.quant_cpu`,
:mod:`leank_infer.vllm.cpu_decode`; that module's docstring says why ctypes and not a PyTorch extension or
numba). The first :meth:`NativeLibrary.available` compiles the source with the system C++ compiler
(``$CXX``, else ``c++``, ``g++``, ``clang++``) into ``~/.cache/leank/<folder>/`` (or ``$LEANK_CACHE``), the
file named by a hash of the source, the flags, the compiler and the CPU (``-march=native`` code may not run on
another CPU of a shared home); later processes load it in milliseconds. The flags are tried in order
(:data:`TRIES`), the first that builds wins. Where no compiler works, or the kernel's environment switch is
``0``, ``available()`` is false and the caller keeps its PyTorch path (logged once).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

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
        errors = []
        for flags in [extra] if extra is not None else TRIES:
            every = FLAGS + flags
            key = hashlib.sha256("\0".join([source, *every, cxx, cpu_id()]).encode()).hexdigest()[:16]
            lib_path = directory / f"leank_{self.source.stem}_{key}.so"
            if lib_path.exists():
                return lib_path
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=directory) as tmp:
                src = Path(tmp) / self.source.name
                src.write_text(source)
                so = Path(tmp) / lib_path.name
                run = subprocess.run([cxx, *every, "-o", str(so), str(src)], capture_output=True, text=True)
                if run.returncode == 0:
                    os.replace(so, lib_path)  # atomic: a concurrent builder never loads half a file
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
