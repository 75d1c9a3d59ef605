"""The vLLM CPU decode kernel before and after a change, in one process: another source of ``cpu_decode.cpp`` (A)
against this checkout's (B), alternating step by step, and whether they give the same bits.

One decode step is one :func:`leank_infer.vllm.cpu_decode.decode` call per layer of the mask, over the pages of
benchmarks/vllm_kernel.py (shuffled blocks of 16 tokens, every request at the same context). The C ABI must be the
same in both sources for ``leank_cpu_decode``, the one function compared (the Python side is this checkout's). Figures: the median over 15 steps of the calling
thread's CPU time on one thread (robust on a shared machine), wall time on more.

    git show HEAD~1:leank_infer/vllm/cpu_decode.cpp > /tmp/base.cpp
    python benchmarks/vllm_kernel_ab.py /tmp/base.cpp [--contexts 1024,4096] [--batches 1,4] [--threads 1]
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import statistics
import time
from pathlib import Path

import torch
from vllm_kernel import HQ, ROOT, leank_pages

from leank_infer.decode.native_build import NativeLibrary
from leank_infer.mask import ChannelMask
from leank_infer.vllm import cpu_decode
from leank_infer.vllm.pool import WorkerPlan


def declare_decode(lib: ctypes.CDLL) -> None:
    """The one function compared (an older source may lack the library's later functions)."""
    lib.leank_cpu_decode.restype = ctypes.c_int
    lib.leank_cpu_decode.argtypes = [ctypes.POINTER(cpu_decode._Args)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("base", help="the other cpu_decode.cpp (A)")
    p.add_argument("--mask", default=str(ROOT / "hub" / "smollm2-135m-instruct-s3"))
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=15)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    other = NativeLibrary(Path(a.base), "vllm-kernel", cpu_decode.ENV_SWITCH, "CPU decode kernel (A)",
                          declare_decode, logging.getLogger(__name__))
    lib_a = ctypes.CDLL(str(other.build()))
    declare_decode(lib_a)
    if not cpu_decode.available():
        raise SystemExit("this checkout's CPU decode kernel is not available (no C++ compiler?)")
    lib_b = cpu_decode.LIBRARY.lib
    mask = ChannelMask.from_pretrained(a.mask)
    layers = [i for i in range(mask.num_layers) if i not in mask.dense_layers]
    plan = WorkerPlan.build(mask, layers, block_size=16)
    d = mask.head_dim
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    print(f"load {os.getloadavg()[0]:.1f} (1 min); {a.threads} thread(s); ms per step ({len(layers)} layers), "
          f"median of {a.steps}, A and B alternating")
    for context in (int(x) for x in a.contexts.split(",")):
        for batch in (int(x) for x in a.batches.split(",")):
            g = torch.Generator().manual_seed(0)
            q = torch.randn(batch, HQ, d, generator=g)
            seq = torch.full((batch,), context, dtype=torch.int32)
            packed, table, window, wtable = leank_pages(plan, batch, context, g, 16)
            calls = [(q, s.packed_view(packed), table, s.window_view(window), wtable, seq, plan, s.in_view(), d**-0.5)
                     for s in (plan.slots[i] for i in layers)]
            outs: dict[str, list[torch.Tensor]] = {}
            times: dict[str, list[float]] = {"A": [], "B": []}
            for rep in range(a.steps + 1):  # the first round warms up
                for name, lib in (("A", lib_a), ("B", lib_b)):
                    cpu_decode.LIBRARY.lib = lib
                    t = clock()
                    outs[name] = [cpu_decode.decode(*c) for c in calls]
                    if rep:
                        times[name].append(1e3 * (clock() - t))
            cpu_decode.LIBRARY.lib = lib_b
            same = all(torch.equal(x, y) for x, y in zip(outs["A"], outs["B"], strict=True))
            ta, tb = statistics.median(times["A"]), statistics.median(times["B"])
            print(f"batch {batch} context {context}: A {ta:.2f} ms, B {tb:.2f} ms, B/A {tb / ta:.3f}, "
                  f"same bits: {same}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
