"""The vLLM CPU decode kernel's merge of a request's pieces under many threads (leank_infer/vllm/cpu_decode.cpp).

A request whose middle is longer than one piece is computed in pieces on several threads and their softmax states
merged into its output. Two checks that each output is written by one thread, once every piece it reads is done:

- ThreadSanitizer: the kernel built with ``-fsanitize=thread``, one call with 8 threads over requests of many
  pieces, in a fresh process. GCC's OpenMP runtime is not instrumented, so TSan cannot see its barriers and
  thread-pool hand-offs: reports where one side is the ``free`` after the parallel region, or where a read meets a
  write ordered only by a barrier, are its blind spots, not races. Two unordered *writes* to one address inside the
  kernel (two threads writing one output) have no such excuse: the test fails on any.
- Adversarial scheduling: the same call thousands of times with more threads than cores (pieces finish in varied
  order, threads are preempted mid-merge), every output equal to the bit to the one-thread result.

Pieces are one tile (``SPLIT`` = 128) here so that every request has many pieces and merges are as frequent as
they can be.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm_pages import random_mask, random_pages

from leank_infer.vllm import cpu_decode

if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler: the kernel cannot be built here", allow_module_level=True)

LENGTHS = [700, 1300, 2100, 900, 1700, 600, 2500, 1100, 40, 3000]  # 1 to 23 pieces of 128 middle keys each

TSAN_SCRIPT = r"""
import ctypes, sys, torch
torch.set_num_threads(1)  # no OpenMP team before the kernel's own: its threads are created (and seen) by the call
sys.path.insert(0, sys.argv[1])
from vllm_pages import random_mask, random_pages
from leank_infer.vllm import cpu_decode
cpu_decode.LIBRARY.use(ctypes.CDLL(sys.argv[2]))
cpu_decode.SPLIT = 128
cpu_decode._layer_cache.clear()
mask = random_mask(1, 3, 64, [32, 0, 64], sink_size=16, recent_size=64, accumu_size=16)
pg = random_pages(mask, [int(n) for n in sys.argv[3].split(",")], q_heads=9, seed=21)
args = (pg.q, pg.packed, pg.packed_table, pg.window, pg.window_table, pg.seq_lens, pg.plan, pg.slot, 0.125)
one = cpu_decode.decode(*args)
torch.set_num_threads(8)
many = cpu_decode.decode(*args)  # one parallel region: the only one this process runs
print("same bits", torch.equal(one, many), flush=True)
"""


def _write_write_races(stderr: str) -> list[str]:
    """The TSan reports of two writes to one address, neither of them the ``free`` after the parallel region."""
    out = []
    for report in stderr.split("WARNING: ThreadSanitizer:")[1:]:
        accesses = re.findall(r"^\s*(?:Previous )?(?:atomic )?(write|read) of size \d+ at \S+ by [^\n]*\n\s+#0 (\S+)",
                              report, re.M | re.I)
        if len(accesses) >= 2 and all(kind.lower() == "write" for kind, _ in accesses[:2]) and \
                "free" not in (accesses[0][1], accesses[1][1]):
            out.append(report.strip()[:1500])
    return out


def test_no_two_threads_write_one_output_under_thread_sanitizer(tmp_path):
    libtsan = subprocess.run(["g++", "-print-file-name=libtsan.so"], capture_output=True, text=True).stdout.strip()
    if not libtsan or not Path(libtsan).exists():
        pytest.skip("no ThreadSanitizer runtime for g++ here")
    lib = cpu_decode.build(["-fsanitize=thread", "-g", "-O1", "-fopenmp"], tmp_path)
    env = {
        **os.environ,
        "LD_PRELOAD": os.path.realpath(libtsan),
        "TSAN_OPTIONS": "exitcode=0 history_size=4",  # judged below: some reports are TSan's blind spots
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "OMP_NUM_THREADS": "1",
    }
    r = subprocess.run(
        [sys.executable, "-c", TSAN_SCRIPT, str(Path(__file__).parent), str(lib), ",".join(map(str, LENGTHS))],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0 and "same bits True" in r.stdout, r.stdout[-2000:] + r.stderr[-6000:]
    races = _write_write_races(r.stderr)
    assert not races, f"{len(races)} write-write races, the first:\n{races[0]}"


def test_outputs_are_the_same_bits_whatever_order_the_pieces_finish_in(monkeypatch):
    """Thousands of calls with 3, 8 and 16 threads on whatever cores there are: every output is the one-thread
    output to the bit (a merge that ran before its last piece, or two merges of one request, would differ)."""
    monkeypatch.setattr(cpu_decode, "SPLIT", 128)
    monkeypatch.setattr(cpu_decode, "_layer_cache", {})
    before = torch.get_num_threads()
    mask = random_mask(1, 3, 64, [32, 0, 64], sink_size=16, recent_size=64, accumu_size=16)
    pg = random_pages(mask, LENGTHS[:8], q_heads=9, seed=21)
    args = (pg.q, pg.packed, pg.packed_table, pg.window, pg.window_table, pg.seq_lens, pg.plan, pg.slot, 0.125)
    assert cpu_decode.available()
    try:
        torch.set_num_threads(1)
        one = cpu_decode.decode(*args)
        differ = 0
        for _ in range(700):
            for threads in (3, 8, 16):
                torch.set_num_threads(threads)
                differ += not torch.equal(cpu_decode.decode(*args), one)
    finally:
        torch.set_num_threads(before)
    assert differ == 0, f"{differ} of 2100 calls differ from the one-thread result"
