"""The host heap of a CPU training process: give the student's freed score blocks back to the system.

Why: glibc's ``malloc`` serves a block of at least its mmap threshold (128 KiB at start) with its own
``mmap`` and unmaps it on ``free``, but each such ``free`` raises the threshold to that block's size (up to
32 MiB). After that the student's per-chunk score tensors (``heads x 256 x prompt`` floats) come from the
heap, and the heap keeps growing over a step though what is alive stays small: the positional student (the
whole prompt under the LeanK rule, with grad) could not train at 4,096 tokens in 24 GB. A fixed threshold
(which also stops its rise) bounds the step's memory, at the price of a fresh mapping per score block:
``benchmarks/student_heap.py`` measures both (docs/training.md, "Masks for the positional rule").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import warnings

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
THRESHOLD = 4 * 1024 * 1024  # SmolLM2's score chunk (9 heads x 256 queries) is above it from 456 keys on


def uses_glibc() -> bool:
    """This process's C library is glibc (the allocator the threshold belongs to)."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def fix_mmap_threshold(nbytes: int = THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` for this process (True when set; other C libraries: False).

    The same as starting the process with ``MALLOC_MMAP_THRESHOLD_=nbytes``; a number the user set there
    wins (nothing is done then), so the allocator stays theirs to tune. A value glibc cannot read as a
    number (which glibc ignores, leaving the rising threshold) is named in one warning and replaced.
    """
    if not uses_glibc():
        return False
    user = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if user is not None:
        if user.strip().isdigit():
            return False
        warnings.warn(f"MALLOC_MMAP_THRESHOLD_={user!r} is not a number of bytes (glibc ignores it): leank fixes "
                      f"the threshold at {nbytes:,} bytes instead", stacklevel=2)
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(nbytes)))
