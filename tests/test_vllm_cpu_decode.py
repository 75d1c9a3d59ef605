"""The vLLM plugin's CPU decode kernel (leank_infer/vllm/cpu_decode.py) against the PyTorch reference.

Pages come from tests/vllm_pages.py: laid out as the engine writes them, NaN wherever the rule forbids reading,
blocks strided by more than a page; so a stray read shows as NaN and a wrong region as a mismatch. Runs in the
main environment (the kernel needs a C++ compiler, not vLLM).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm_pages import random_mask, random_pages, reference

from leank_infer.vllm import cpu_decode, kernels

if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler: the kernel cannot be built here", allow_module_level=True)

TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
EMBEDDED = dict(sink_size=16, recent_size=64, accumu_size=16)  # the embedded SmolLM2 masks' sizes
REAL = dict(sink_size=128, recent_size=768, accumu_size=128)  # the Llama / Qwen reference masks' sizes
# p < sink, p < recent, either side of the window's steps (p - recent at, before and after a multiple of
# accumu), a few tiles, many tiles
LENGTHS = [1, 9, 17, 50, 80, 81, 96, 97, 113, 300, 700, 1500, 1504]


@pytest.fixture(autouse=True)
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run(pg, threads: int = 1, scale: float = 0.125) -> torch.Tensor:
    torch.set_num_threads(threads)
    assert cpu_decode.available() and cpu_decode.supports(pg.q, pg.packed, pg.window, pg.fp8)
    return cpu_decode.decode(
        pg.q, pg.packed, pg.packed_table, pg.window, pg.window_table, pg.seq_lens, pg.plan, pg.slot, scale,
        pg.k_scale, pg.v_scale, pg.fp8,
    )  # fmt: skip


def check(pg, got: torch.Tensor, tol: float, scale: float = 0.125) -> None:
    want = reference(pg, scale)
    assert torch.isfinite(want).all()
    assert got.dtype == pg.q.dtype and got.shape == pg.q.shape
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size, window_block", [(16, 5), (16, 9), (16, 24), (16, 128), (40, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_pages_of_a_block_size_of_their_own(dtype, block_size, window_block):
    """Window pages whose blocks hold another number of tokens than the packed pages (pool.fit_blocks; 40 and 24:
    what it picks for ``-s3`` on CPU): the sink and window keys are read through the window table at their own block
    size, the rest through the packed one."""
    mask = random_mask(2, 3, 64, [32, 0, 64, 7], seed=1, **EMBEDDED)
    pg = random_pages(
        mask, LENGTHS, q_heads=9, dtype=dtype, seed=2, block_size=block_size, window_block=window_block
    )
    assert pg.window.shape[1] == window_block != pg.packed.shape[1]
    check(pg, run(pg, 2), TOL[dtype])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize(
    "dtype, fp8",
    [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None), (torch.float32, "e4m3"),
     (torch.float32, "e5m2")],
    ids=["fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2"],
)  # fmt: skip
def test_embedded_shapes_every_dtype(dtype, fp8, block_size, threads):
    """SmolLM2's shapes (3 KV heads x 3 queries, head_dim 64) and sizes; heads keeping 32, none, all, 7 channels
    (layer 0 cycles through them); mixed lengths in one batch; every storage dtype with its scales."""
    mask = random_mask(2, 3, 64, [32, 0, 64, 7], seed=1, **EMBEDDED)
    pg = random_pages(mask, LENGTHS, q_heads=9, block_size=block_size, dtype=dtype, fp8=fp8, seed=2)
    check(pg, run(pg, threads), TOL[dtype])


def test_fp8_under_a_half_precision_model():
    """fp8 pages under a bf16 query: the scales still apply, the result comes back in bf16."""
    mask = random_mask(1, 3, 64, [16, 64, 0], **EMBEDDED)
    pg = random_pages(mask, [40, 400, 900], q_heads=6, fp8="e4m3", seed=3)
    pg.q = pg.q.to(torch.bfloat16)
    check(pg, run(pg, 2), TOL[torch.bfloat16])


@pytest.mark.parametrize("block_size", [16, 128])
def test_more_than_two_tiles_of_full_channel_keys(block_size):
    """A window of ~300 full-channel keys (sink 16 + recent 272..288): three tiles of 128, the last one partial."""
    mask = random_mask(1, 2, 32, [8, 24], sink_size=16, recent_size=272, accumu_size=16)
    lengths = [290, 300, 301, 317, 600, 1000]
    pg = random_pages(mask, lengths, q_heads=4, block_size=block_size, seed=4)
    check(pg, run(pg, 2), TOL[torch.float32])


@pytest.mark.parametrize(
    "heads, q_heads, counts",
    [(8, 32, [16, 0, 128, 48, 32, 0, 64, 80]), (4, 28, [32, 128, 0, 96])],
    ids=["llama-8b", "qwen2.5-7b"],
)
def test_real_masks_sizes(heads, q_heads, counts):
    """The reference masks' sizes (sink 128, recent 768, accumu 128) and shapes (head_dim 128, GQA 4 and 7):
    several tiles of sink, window and middle keys, lengths on either side of the window's steps."""
    mask = random_mask(1, heads, 128, counts, seed=5, **REAL)
    lengths = [1, 100, 129, 897, 1024, 1025, 2200]
    pg = random_pages(mask, lengths, q_heads=q_heads, block_size=128, seed=6)
    check(pg, run(pg, 2), TOL[torch.float32])


@pytest.mark.parametrize("counts", [[0], [20]], ids=["keeps-nothing", "keeps-everything"])
def test_a_layer_keeping_nothing_or_everything(counts):
    """A layer whose heads keep no channel (its packed row is one padding element: only sink and window keys are
    seen) and one keeping every channel (the middle is plain attention over packed rows); head_dim 20 (no
    multiple of 8: the kernel's scalar tails)."""
    mask = random_mask(2, 2, 20, counts, align=4, **EMBEDDED)
    pg = random_pages(mask, LENGTHS, q_heads=4, seed=7)
    check(pg, run(pg, 2), TOL[torch.float32])


@pytest.mark.parametrize("group", [1, 10], ids=["mha", "gqa-10"])
def test_any_group_size(group):
    """One query head per KV head, and more than the 8 the kernel keeps in registers at once; kept counts that
    are no multiple of 8 (13: the scalar tail of the kept-channel dot)."""
    mask = random_mask(1, 2, 64, [40, 13], **EMBEDDED)
    pg = random_pages(mask, [30, 200, 1200], q_heads=2 * group, seed=8)
    check(pg, run(pg, 2), TOL[torch.float32])


def test_no_sink():
    """sink_size 0: the recent window from max(0, rf) (rf < 0 while p < recent), the middle from key 0."""
    mask = random_mask(1, 2, 32, [8, 24], sink_size=0, recent_size=64, accumu_size=16)
    pg = random_pages(mask, [1, 30, 64, 65, 80, 96, 400], q_heads=4, seed=11)
    check(pg, run(pg, 2), TOL[torch.float32])


@pytest.mark.parametrize(
    "dtype, fp8", [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None), (torch.float32, "e4m3")]
)
def test_a_nan_the_kernel_reads_shows_in_the_result(dtype, fp8):
    """What every test above relies on: a NaN in a slot the kernel reads (here a channel of KV head 0 in the
    query's own K) reaches the output of every query head of that KV head, in every storage dtype (so the NaN
    pages catch any stray read)."""
    mask = random_mask(1, 3, 64, [32, 0, 64], **EMBEDDED)
    pg = random_pages(mask, [300, 300], q_heads=9, dtype=dtype, fp8=fp8, seed=12)
    bs, p = pg.window.shape[1], 299
    block = int(pg.window_table[1, p // bs])
    pg.window[block, p % bs, pg.slot.window_offset + 5] = 0x7F if fp8 else float("nan")
    got = run(pg, 2)
    assert torch.isfinite(got[0]).all() and torch.isnan(got[1, :3]).all() and torch.isfinite(got[1, 3:]).all()


def test_the_thread_count_does_not_change_a_bit():
    """Long middles are cut into pieces by their length, never by the thread count: 1, 2 and 3 threads agree
    exactly (and a batch of one request equals the same request inside a batch)."""
    mask = random_mask(1, 3, 64, [32, 0, 64], **EMBEDDED)
    pg = random_pages(mask, [5, 100, 700, 3000], q_heads=9, seed=9)
    outs = [run(pg, t) for t in (1, 2, 3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    check(pg, outs[0], TOL[torch.float32])
    one = cpu_decode.decode(
        pg.q[3:], pg.packed, pg.packed_table[3:], pg.window, pg.window_table[3:], pg.seq_lens[3:], pg.plan,
        pg.slot, 0.125,
    )  # fmt: skip
    assert torch.equal(one[0], outs[0][3])


def runs_pages(pg, queries: list[int], seed: int = 0):
    """``pg``'s requests as runs of ``queries[r]`` rows each (positions up to the request's last, over its tables),
    each row with a query of its own: what the metadata builder hands the kernel for speculative drafts."""
    rows = [r for r, n in enumerate(queries) for _ in range(n)]
    back = [n - 1 - j for n in queries for j in range(n)]
    lens = [int(pg.seq_lens[r]) - k for r, k in zip(rows, back, strict=True)]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(rows), *pg.q.shape[1:], generator=g).to(pg.q.dtype)
    idx = torch.tensor(rows)
    return dataclasses.replace(
        pg, q=q, packed_table=pg.packed_table[idx], window_table=pg.window_table[idx],
        seq_lens=torch.tensor(lens, dtype=torch.int32), keys=[pg.keys[r][:n] for r, n in zip(rows, lens, strict=True)],
        values=[pg.values[r][:n] for r, n in zip(rows, lens, strict=True)],
    )  # fmt: skip


def run_runs(pg, queries: list[int] | None, threads: int = 1) -> torch.Tensor:
    torch.set_num_threads(threads)
    return cpu_decode.decode(
        pg.q, pg.packed, pg.packed_table, pg.window, pg.window_table, pg.seq_lens, pg.plan, pg.slot, 0.125,
        pg.k_scale, pg.v_scale, pg.fp8, runs=None if queries is None else cpu_decode.runs_of(queries),
    )  # fmt: skip


# (the run's last length, its queries): runs before the sink and the first window step, runs crossing a step of
# the window (p - recent across a multiple of accumu: the later queries score more middle keys than the first), runs
# over one and several pieces of the shared middle (SPLIT keys each), a row alone between runs, the builder's most
RUNS = [(9, 3), (80, 4), (97, 2), (113, 4), (700, 4), (1500, 1), (1504, 5), (3000, 16)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "dtype, fp8", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "e4m3")], ids=["fp32", "bf16", "fp8"]
)
def test_a_run_of_drafts_scores_each_query_by_its_own_position(dtype, fp8, threads):
    """Rows marked as a run (speculative drafts: one request's queries at consecutive positions) read the middle they
    share once for all of them, yet each query is scored by the rule at its own position: the result is the
    reference's, row for row, and within rounding of the rows decoded one by one. The pages hold NaN wherever no query
    of the run may read every channel (before the first query's window), so a stray read there shows as NaN; a later
    query scoring keys between the first query's window and its own with every channel shows as a mismatch."""
    mask = random_mask(2, 3, 64, [32, 0, 64, 7], seed=1, **EMBEDDED)
    queries = [n for _, n in RUNS]
    pg = random_pages(
        mask, [n for n, _ in RUNS], q_heads=9, dtype=dtype, fp8=fp8, seed=14, lookback=max(queries) - 1
    )
    rp = runs_pages(pg, queries, seed=15)
    got = run_runs(rp, queries, threads)
    check(rp, got, 4e-3 if fp8 else TOL[dtype])
    alone = run_runs(rp, None, threads)
    torch.testing.assert_close(got.float(), alone.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert not torch.equal(got, alone)  # the shared middle really is another cut of the work


def test_runs_give_the_same_bits_at_any_thread_count():
    """A run's pieces are cut by its lengths alone: 1, 2 and 3 threads agree exactly."""
    mask = random_mask(1, 3, 64, [32, 0, 64], **EMBEDDED)
    queries = [4, 1, 8]
    rp = runs_pages(random_pages(mask, [700, 100, 3000], q_heads=9, seed=16, lookback=7), queries, seed=17)
    outs = [run_runs(rp, queries, t) for t in (1, 2, 3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    check(rp, outs[0], TOL[torch.float32])


def test_a_run_whose_positions_are_not_consecutive_is_refused():
    """A run is a promise that its rows are one request's consecutive queries; rows that are not get the kernel's
    bad-argument error, not a result scored over another request's middle."""
    mask = random_mask(1, 3, 64, [32, 0, 64], **EMBEDDED)
    pg = random_pages(mask, [700, 705], q_heads=9, seed=18, lookback=4)
    with pytest.raises(RuntimeError, match="consecutive positions"):
        run_runs(pg, [2])
    with pytest.raises(RuntimeError, match="consecutive positions"):  # a run longer than the rows
        run_runs(dataclasses.replace(pg, q=pg.q[:1]), [2])
    pg = dataclasses.replace(pg, seq_lens=torch.tensor([700, 701], dtype=torch.int32))
    for runs in ([0, 0], [2, 1], [-1, 0]):  # no run at a run's start, a second start inside a run
        with pytest.raises(RuntimeError, match="consecutive positions"):
            cpu_decode.decode(pg.q, pg.packed, pg.packed_table, pg.window, pg.window_table, pg.seq_lens, pg.plan,
                              pg.slot, 0.125, runs=torch.tensor(runs, dtype=torch.int32))
    for runs in (torch.tensor([2, 0]), torch.tensor([2, 0], dtype=torch.int32, device="meta")):  # int64; off the CPU
        with pytest.raises(ValueError, match="runs must be int32 on the CPU"):
            cpu_decode.decode(pg.q, pg.packed, pg.packed_table, pg.window, pg.window_table, pg.seq_lens, pg.plan,
                              pg.slot, 0.125, runs=runs)


def test_kernels_decode_runs_the_kernel_on_cpu_and_the_reference_without_it(monkeypatch, caplog):
    """kernels.decode calls the kernel for CPU tensors; without it (no compiler, switched off) it falls back to
    the PyTorch path, warning once."""
    mask = random_mask(1, 3, 64, [32, 0, 64], **EMBEDDED)
    pg = random_pages(mask, [20, 300], q_heads=9, seed=10)
    args = (
        pg.q,
        pg.packed,
        pg.packed_table,
        pg.window,
        pg.window_table,
        pg.seq_lens,
        pg.plan,
        pg.slot,
        0.125,
    )
    calls = []
    real = cpu_decode.decode
    monkeypatch.setattr(cpu_decode, "decode", lambda *a: calls.append(1) or real(*a))
    check(pg, kernels.decode(*args), TOL[torch.float32])
    assert calls == [1]
    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    with caplog.at_level("WARNING", logger=kernels.__name__):
        check(pg, kernels.decode(*args), TOL[torch.float32])
        check(pg, kernels.decode(*args), TOL[torch.float32])
    assert calls == [1]
    assert caplog.text.count("CPU decode kernel is not available") == 1


def test_tensors_the_kernel_does_not_cover_take_the_reference(monkeypatch, caplog):
    """Pages whose rows are not contiguous in a block (and any dtype the kernel does not read) go to the PyTorch
    path, with one warning; the kernel is not called."""
    mask = random_mask(1, 3, 64, [32, 0, 64], **EMBEDDED)
    pg = random_pages(mask, [20, 300], q_heads=9, seed=13)
    wide = torch.full((pg.packed.shape[0], pg.packed.shape[1], pg.packed.shape[2] + 3), float("nan"))
    wide[:, :, : pg.packed.shape[2]] = pg.packed
    pg.packed = wide[:, :, : pg.packed.shape[2]]  # rows 3 elements apart: not the engine's layout
    assert not cpu_decode.supports(pg.q, pg.packed, pg.window)
    monkeypatch.setattr(cpu_decode, "decode", lambda *a: pytest.fail("the kernel was called"))
    monkeypatch.setattr(kernels, "_warned", set())
    args = (pg.q, pg.packed, pg.packed_table, pg.window, pg.window_table, pg.seq_lens, pg.plan, pg.slot, 0.125)
    with caplog.at_level("WARNING", logger=kernels.__name__):
        check(pg, kernels.decode(*args), TOL[torch.float32])
        kernels.decode(*args)
    assert caplog.text.count("does not cover") == 1


def test_a_failed_build_is_logged_and_leaves_the_kernel_off(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_decode.LIBRARY, "tried", False)
    monkeypatch.setattr(cpu_decode.LIBRARY, "lib", None)
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("LEANK_CACHE", str(tmp_path))
    with caplog.at_level("WARNING", logger=cpu_decode.__name__):
        assert not cpu_decode.available()
        assert not cpu_decode.available()
    assert caplog.text.count("CPU decode kernel is not available") == 1
    assert not list(tmp_path.rglob("*.so"))


ASAN_SCRIPT = r"""
import ctypes, sys, torch
sys.path.insert(0, sys.argv[1])
from vllm_pages import random_mask, random_pages, reference
from leank_infer.vllm import cpu_decode
cpu_decode.LIBRARY.use(ctypes.CDLL(sys.argv[2]))
torch.set_num_threads(2)
for counts, sizes, heads, d, q_heads, lengths, bs, fp8, wb in [
    ([32, 0, 64, 7], dict(sink_size=16, recent_size=64, accumu_size=16), 3, 64, 9, [1, 9, 50, 81, 300, 1500], 16, None,
     None),
    ([32, 0, 64, 7], dict(sink_size=16, recent_size=64, accumu_size=16), 3, 64, 9, [1, 50, 301, 1500], 16, None, 7),
    ([0], dict(sink_size=16, recent_size=64, accumu_size=16, align=8), 2, 24, 4, [1, 40, 700], 16, None, None),
    ([16, 128, 0, 96], dict(sink_size=128, recent_size=768, accumu_size=128), 4, 128, 28, [1, 129, 1025, 2200], 128, "e5m2",
     None),
]:
    pg = random_pages(random_mask(1, heads, d, counts, **sizes), lengths, q_heads=q_heads, block_size=bs, fp8=fp8,
                      extra_block_stride=0, window_block=wb)
    # the tightest buffers: a pool that ends where the last block ends, tables as wide as the longest request
    got = cpu_decode.decode(pg.q, pg.packed, pg.packed_table, pg.window, pg.window_table, pg.seq_lens, pg.plan,
                            pg.slot, 0.125, pg.k_scale, pg.v_scale, pg.fp8)
    torch.testing.assert_close(got, reference(pg, 0.125), atol=1e-5, rtol=1e-5)
    if fp8 is None:  # the gather of a whole prompt, into K/V exactly as long as it
        whole = random_pages(random_mask(1, heads, d, counts, **sizes), [lengths[-1]], q_heads=q_heads,
                             block_size=bs, extra_block_stride=0, whole_window=True, window_block=wb)
        n = lengths[-1]
        k, v = torch.empty(n, heads, d), torch.empty(n, heads, d)
        cpu_decode.gather(whole.packed, whole.packed_table[0], whole.window, whole.window_table[0], n, whole.slot, k, v)
        assert torch.equal(k, whole.keys[0]) and torch.equal(v, whole.values[0])
        first = n // 3 + 1  # the tail from a position inside a block, into K/V exactly as long as it
        k, v = torch.empty(n - first, heads, d), torch.empty(n - first, heads, d)
        cpu_decode.gather(whole.packed, whole.packed_table[0], whole.window, whole.window_table[0], n - first,
                          whole.slot, k, v, first=first)
        assert torch.equal(k, whole.keys[0][first:]) and torch.equal(v, whole.values[0][first:])
        # the write of the last token, its window slot at the window pages' own block size
        p, wbs = n - 1, whole.window.shape[1]
        ps = whole.packed_table[0, p // bs].long().view(1) * bs + p % bs
        ws = whole.window_table[0, p // wbs].long().view(1) * wbs + p % wbs
        before = whole.window.clone()
        cpu_decode.write(whole.packed, ps, whole.window, ws, whole.keys[0][p:], whole.values[0][p:], whole.slot)
        torch.testing.assert_close(whole.window, before, rtol=0, atol=0, equal_nan=True)  # the same values, in place
        pos = torch.arange(n)  # the whole prompt, over two threads
        ps, ws = whole.packed_table[0, pos // bs].long() * bs + pos % bs, whole.window_table[0, pos // wbs].long() * wbs + pos % wbs
        cpu_decode.write(whole.packed, ps, whole.window, ws, whole.keys[0], whole.values[0], whole.slot)
        torch.testing.assert_close(whole.window, before, rtol=0, atol=0, equal_nan=True)
        # the gather and the put into vLLM's CPU page layout, exactly as many pages as the tokens need
        ob = 32
        blocks = -(-n // ob)
        scratch = torch.empty(blocks, heads, 2 * ob, d)
        kp = scratch.as_strided((blocks, heads, ob, d), (scratch.stride(0), scratch.stride(1), 1, ob))
        vp = scratch[:, :, ob:]
        cpu_decode.gather(whole.packed, whole.packed_table[0], whole.window, whole.window_table[0], n, whole.slot, kp,
                          vp, torch.arange(blocks, dtype=torch.int32))
        assert torch.equal(kp.transpose(1, 2).reshape(-1, heads, d)[:n], whole.keys[0])
        scratch.zero_()
        cpu_decode.put(whole.keys[0], whole.values[0], pos, kp, vp)
        assert torch.equal(vp.transpose(1, 2).reshape(-1, heads, d)[:n], whole.values[0])
# runs of speculative queries (one of the builder's most, 16, at the end of the rows), over the tightest tables
pg = random_pages(random_mask(1, 3, 64, [32, 0, 64, 7], sink_size=16, recent_size=64, accumu_size=16), [97, 1500],
                  q_heads=9, extra_block_stride=0, lookback=15)
rows, lens = torch.tensor([0, 0] + [1] * 16), torch.tensor([96, 97] + list(range(1485, 1501)), dtype=torch.int32)
args = (pg.q[rows], pg.packed, pg.packed_table[rows], pg.window, pg.window_table[rows], lens, pg.plan, pg.slot, 0.125)
got = cpu_decode.decode(*args, runs=cpu_decode.runs_of([2, 16]))
torch.testing.assert_close(got, cpu_decode.decode(*args), atol=1e-5, rtol=1e-5)
print("asan ok")
"""


def test_no_out_of_bounds_read_under_address_sanitizer(tmp_path):
    """The kernel built with -fsanitize=address reads only inside its buffers (an overrun aborts the run)."""
    libasan = subprocess.run(
        ["g++", "-print-file-name=libasan.so"], capture_output=True, text=True
    ).stdout.strip()
    if not libasan or not Path(libasan).exists():
        pytest.skip("no AddressSanitizer runtime for g++ here")
    lib = cpu_decode.build(
        ["-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1", "-fopenmp"], tmp_path
    )
    env = {
        **os.environ,
        "LD_PRELOAD": os.path.realpath(libasan),
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=97",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    r = subprocess.run(
        [sys.executable, "-c", ASAN_SCRIPT, str(Path(__file__).parent), str(lib)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0 and "asan ok" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


@pytest.mark.parametrize("wbs", [16, 5], ids=["one-block-size", "window-block-5"])
@pytest.mark.parametrize("counts", [[5, 0, 16], [0, 0, 0], [16, 16, 16]], ids=["mixed", "keeps-nothing", "keeps-all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_write_is_the_reference_write_byte_for_byte(dtype, counts, wbs):
    """cpu_decode.write puts exactly the bytes of paged_reference.write_pages where they go: packed rows (kept K,
    V of heads keeping any, a layer keeping nothing its one padding 0), rest rows only into real window blocks,
    nothing for padding (-1) or the null block; strided K/V as vLLM's qkv split gives them, a layer at a non-zero
    offset of token-major rows; every other byte (NaN) untouched; window blocks of 16 tokens as the packed ones, or
    of 5. kernels.write takes it for these pages."""
    from leank_infer.vllm.paged_reference import write_pages
    from leank_infer.vllm.pool import WorkerPlan

    g = torch.Generator().manual_seed(5)
    mask = random_mask(3, 3, 16, counts, seed=6, align=16)
    bs, nb, n = 16, 6, 9
    plan = WorkerPlan.build(mask, [0, 1, 2], block_size=bs)
    full = 2 * 3 * 16
    slot = dataclasses.replace(plan.slots[1], window_offset=full)  # the second layer of its window store
    assert slot.packed_offset > 0
    wrow = plan.window_row + full
    packed = torch.full((nb, bs * plan.packed_row + 3), float("nan"), dtype=dtype)[:, : bs * plan.packed_row]
    wnb = nb * bs // wbs
    window = torch.full((wnb, wbs * wrow + 5), float("nan"), dtype=dtype)[:, : wbs * wrow]
    packed, window = packed.view(nb, bs, plan.packed_row), window.view(wnb, wbs, wrow)
    qkv = torch.randn(n, (2 + 3 + 3) * 16, generator=g).to(dtype)  # q | k | v of each token, like vLLM's
    k, v = qkv[:, 32:80].view(n, 3, 16), qkv[:, 80:].view(n, 3, 16)
    packed_slots = torch.tensor([17, -1, 40, 3, 95, -1, 66, 33, 18])
    window_slots = torch.tensor([20, -1, 5, 0, 90, 31, 15, 16, 47])  # < wbs: the null block
    if wbs == 5:
        window_slots = torch.tensor([20, -1, 3, 0, 90, 31, 4, 5, 47])
    want_p, want_w = packed.clone(), window.clone()
    write_pages(want_p, packed_slots, want_w, window_slots, k, v, slot)
    assert cpu_decode.supports_write(packed, window, k, v)
    got_p, got_w = packed.clone(), window.clone()
    cpu_decode.write(got_p, packed_slots, got_w, window_slots, k, v, slot)
    raw = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2 else torch.int32)  # noqa: E731
    assert torch.equal(raw(got_p), raw(want_p)) and torch.equal(raw(got_w), raw(want_w))
    # rest rows (the channels the packed row lacks) only: a layer keeping every channel has none to write
    assert torch.equal(raw(want_w), raw(window)) == (slot.layout.rest_width == 0)
    got_p, got_w = packed.clone(), window.clone()
    kernels.write(got_p, packed_slots.int(), got_w, window_slots.int(), k, v, slot)  # int32 slots too
    assert torch.equal(raw(got_p), raw(want_p)) and torch.equal(raw(got_w), raw(want_w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_write_split_over_threads_is_the_reference_write(dtype):
    """A step of 300 tokens (a prompt chunk) is written over two threads: byte for byte paged_reference.write_pages,
    shuffled slots, padding and null-block window slots among them."""
    from leank_infer.vllm.paged_reference import write_pages
    from leank_infer.vllm.pool import WorkerPlan

    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(11)
    plan = WorkerPlan.build(random_mask(2, 3, 16, [5, 0, 16], seed=12, align=16), [0, 1], block_size=16)
    slot, n, nb = plan.slots[1], 300, 24
    packed = torch.full((nb, 16, plan.packed_row), float("nan"), dtype=dtype)
    window = torch.full((nb, 16, plan.window_row), float("nan"), dtype=dtype)
    k, v = torch.randn(n, 3, 16, generator=g).to(dtype), torch.randn(n, 3, 16, generator=g).to(dtype)
    packed_slots = torch.randperm(nb * 16, generator=g)[:n]
    packed_slots[::7] = -1
    window_slots = torch.randperm(nb * 16, generator=g)[:n]  # some in block 0: the null block, not written
    want_p, want_w = packed.clone(), window.clone()
    write_pages(want_p, packed_slots, want_w, window_slots, k, v, slot)
    cpu_decode.write(packed, packed_slots, window, window_slots, k, v, slot)
    raw = lambda t: t.view(torch.int16 if t.element_size() == 2 else torch.int32)  # noqa: E731
    assert torch.equal(raw(packed), raw(want_p)) and torch.equal(raw(window), raw(want_w))


@pytest.mark.parametrize("threads_n", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_put_writes_rows_into_vllms_cpu_page_layout(dtype, threads_n):
    """cpu_decode.put (a prompt step's own K/V into the scratch): token i's K at place slot % block of block
    slot // block, K transposed in a block as vLLM's CPU pages hold it, V rows; runs that cross a block, tokens apart,
    padding (-1) skipped; strided K/V as a qkv split gives them; every other element untouched (NaN). Slots outside
    the pages, or pages of another dtype, get one error."""
    torch.set_num_threads(threads_n)
    g = torch.Generator().manual_seed(13)
    n, heads, dim, bs, blocks = 200, 3, 16, 32, 12
    qkv = torch.randn(n, 9 * dim, generator=g).to(dtype)
    k, v = qkv[:, 3 * dim : 6 * dim].view(n, heads, dim), qkv[:, 6 * dim :].view(n, heads, dim)
    slots = torch.cat([torch.arange(20, 120), torch.randperm(blocks * bs - 120, generator=g)[:100] + 120])
    slots[[5, 150]] = -1
    scratch = torch.full((blocks, heads, 2 * bs, dim), float("nan"), dtype=dtype)
    kp = scratch.as_strided((blocks, heads, bs, dim), (scratch.stride(0), scratch.stride(1), 1, bs))
    vp = scratch[:, :, bs:]
    assert cpu_decode.supports_put(k, v, kp, vp)
    cpu_decode.put(k, v, slots, kp, vp)
    real = slots >= 0
    at = slots[real]
    assert torch.equal(kp[at // bs, :, at % bs], k[real]) and torch.equal(vp[at // bs, :, at % bs], v[real])
    assert int(scratch.isnan().sum()) == scratch.numel() - 2 * k[real].numel()  # nothing else written
    with pytest.raises(ValueError, match="slots inside pages"):
        cpu_decode.put(k, v, torch.full((n,), blocks * bs), kp, vp)
    with pytest.raises(ValueError, match="of their dtype"):
        cpu_decode.put(k.float() if dtype != torch.float32 else k.half(), v, slots, kp, vp)


def test_the_write_leaves_fp8_and_odd_tensors_to_the_reference(monkeypatch):
    """fp8 pages (scales, rounding), mixed dtypes and rows not contiguous take the PyTorch write."""
    mask = random_mask(1, 3, 16, [5, 0, 16], seed=6, align=16)
    slot = __import__("leank_infer.vllm.pool", fromlist=["WorkerPlan"]).WorkerPlan.build(mask, [0]).slots[0]
    pages = torch.zeros(4, 16, 64)
    k = v = torch.zeros(2, 3, 16)
    assert cpu_decode.supports_write(pages, pages, k, v)
    assert not cpu_decode.supports_write(pages.to(torch.uint8), pages.to(torch.uint8), k, v, torch.float8_e4m3fn)
    assert not cpu_decode.supports_write(pages, pages, k.double(), v.double())
    assert not cpu_decode.supports_write(pages, pages, k.to(torch.bfloat16), v)
    assert not cpu_decode.supports_write(pages, pages, torch.zeros(2, 16, 3).transpose(1, 2), v)
    monkeypatch.setattr(cpu_decode, "write", lambda *a: pytest.fail("the C write was called"))
    from leank_infer.vllm import paged_reference

    calls = []
    monkeypatch.setattr(kernels, "write_pages", lambda *a: calls.append(a[-1]))
    kernels.write(pages.to(torch.uint8), torch.zeros(2, dtype=torch.long), pages.to(torch.uint8),
                  torch.zeros(2, dtype=torch.long), k, v, slot, 1.0, 1.0, torch.float8_e4m3fn)  # fmt: skip
    assert calls == [torch.float8_e4m3fn] and paged_reference.write_pages is not None


@pytest.mark.parametrize("window_block", [None, 7])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("counts", [[5, 0, 16], [0, 0, 0], [16, 16, 16]], ids=["mixed", "keeps-nothing", "keeps-all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_prompt_gather_is_the_reference_gather(dtype, counts, block_size, threads, window_block):
    """cpu_decode.gather (the dense-prompt rule's prefill reads every earlier prompt token) gives paged_reference's
    full_rows bit for bit, and so the very K/V that were written: a layer at a non-zero offset of its rows,
    shuffled blocks strided by more than a page (NaN between), requests long and short; kernels.prompt_kv takes
    it and equals request_kv(whole=True), the chunk's own K/V after the gathered ones. Window pages of the plan's block
    size or of 7 tokens; a run from the middle of a prompt (``first``) reads the same rows as the whole gather."""
    from unittest import mock

    from leank_infer.vllm.paged_reference import full_rows, request_kv

    real_gather = cpu_decode.gather
    torch.set_num_threads(threads)
    mask = random_mask(2, 3, 16, counts, seed=7, align=16)
    lengths = [1, 15, 16, 17, 300]
    pg = random_pages(
        mask, lengths, layer=1, block_size=block_size, dtype=dtype, seed=8, whole_window=True, window_block=window_block
    )
    assert pg.slot.packed_offset > 0 and cpu_decode.supports_gather(pg.packed, pg.window, dtype)
    for b, n in enumerate(lengths):
        tables = (pg.packed, pg.packed_table[b], pg.window, pg.window_table[b])
        k = torch.full((n + 3, 3, 16), -7.0, dtype=dtype)  # a value no page holds (their unwritten rows are NaN)
        v = torch.full((n + 3, 3, 16), -7.0, dtype=dtype)
        cpu_decode.gather(*tables[:2], *tables[2:], n, pg.slot, k, v)
        want_k, want_v = full_rows(pg.plan, pg.slot, *tables, torch.arange(n), dtype)
        assert torch.equal(k[:n], want_k) and torch.equal(v[:n], want_v)
        assert torch.equal(k[:n], pg.keys[b]) and torch.equal(v[:n], pg.values[b])
        assert (k[n:] == -7.0).all() and (v[n:] == -7.0).all()  # nothing written past the n tokens
        # paged: vLLM's CPU page layout (K transposed in a block, V rows), blocks of 8 in shuffled order
        blocks = -(-n // 8)
        out_table = torch.randperm(blocks + 2, generator=torch.Generator().manual_seed(n))[:blocks].int()
        scratch = torch.full((blocks + 2, 3, 16, 16), -7.0, dtype=dtype)
        kp = scratch.as_strided((blocks + 2, 3, 8, 16), (scratch.stride(0), scratch.stride(1), 1, 8))
        vp = scratch[:, :, 8:]
        cpu_decode.gather(*tables[:2], *tables[2:], n, pg.slot, kp, vp, out_table)
        t = torch.arange(n)
        at = (out_table[t // 8].long(), slice(None), t % 8)
        assert torch.equal(kp[at[0], :, at[2]], want_k) and torch.equal(vp[at[0], :, at[2]], want_v)
        assert int((scratch == -7.0).sum()) == scratch.numel() - 2 * want_k.numel()  # nothing else written
        first = n // 3  # the tokens [first, n) only, the tables from the request's first token
        kk, vv = torch.full_like(k, -7.0), torch.full_like(v, -7.0)
        cpu_decode.gather(*tables[:2], *tables[2:], n - first, pg.slot, kk, vv, first=first)
        assert torch.equal(kk[: n - first], want_k[first:]) and torch.equal(vv[: n - first], want_v[first:])
        rows = torch.empty_like(kk), torch.empty_like(vv)
        kernels.prompt_rows(pg.plan, pg.slot, *tables, n - first, *rows, first=first)
        assert torch.equal(rows[0][: n - first], want_k[first:]) and torch.equal(rows[1][: n - first], want_v[first:])
        slow = [torch.full((n + 3, 16, 3), -7.0, dtype=dtype).transpose(1, 2) for _ in range(2)]
        kernels.prompt_rows(pg.plan, pg.slot, *tables, n - first, *slow, first=first)  # not contiguous: PyTorch's
        assert torch.equal(slow[0][: n - first], want_k[first:]) and torch.equal(slow[1][: n - first], want_v[first:])
        if dtype != torch.float32:  # 2-byte pages into fp32 rows (kv_cache_dtype bfloat16): the library's, widened
            wide = [torch.full((n + 3, 3, 16), -7.0) for _ in range(2)]
            with mock.patch.object(cpu_decode, "gather", wraps=real_gather) as library:
                kernels.prompt_rows(pg.plan, pg.slot, *tables, n - first, *wide, first=first)
            assert library.called and torch.equal(wide[0][: n - first], want_k[first:].float())
            assert torch.equal(wide[1][: n - first], want_v[first:].float()) and (wide[0][n - first :] == -7.0).all()
        first = n // 2  # a chunk from the middle of the prompt on: its own K/V follow the gathered ones
        new_k, new_v = pg.keys[b][first:] * 2, pg.values[b][first:] * 2
        got = kernels.prompt_kv(pg.plan, pg.slot, *tables, n, first, new_k, new_v, dtype)
        want = request_kv(pg.plan, pg.slot, *tables, n, first, new_k, new_v, dtype, whole=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_prompt_gather_leaves_fp8_and_odd_pages_to_pytorch(monkeypatch):
    """fp8 pages (scales), pages of another dtype than the model's and K/V the gather cannot write into take the
    PyTorch gather, or one error naming the tensors."""
    mask = random_mask(1, 3, 16, [5, 0, 16], seed=6, align=16)
    pg = random_pages(mask, [40], fp8="e4m3", seed=9, whole_window=True)
    assert not cpu_decode.supports_gather(pg.packed, pg.window, torch.float32)
    assert not cpu_decode.supports_gather(pg.packed.float(), pg.window.float(), torch.bfloat16)
    monkeypatch.setattr(cpu_decode, "gather", lambda *a: pytest.fail("the C gather was called"))
    k, v = kernels.prompt_kv(pg.plan, pg.slot, pg.packed, pg.packed_table[0], pg.window, pg.window_table[0], 40, 39,
                             pg.keys[0][39:], pg.values[0][39:], torch.float32, pg.k_scale, pg.v_scale, pg.fp8)  # fmt: skip
    torch.testing.assert_close(k, pg.keys[0])
    torch.testing.assert_close(v, pg.values[0])
    monkeypatch.undo()
    fp = random_pages(mask, [40], seed=9, whole_window=True)
    with pytest.raises(ValueError, match="contiguous K/V"):
        cpu_decode.gather(fp.packed, fp.packed_table[0], fp.window, fp.window_table[0], 40, fp.slot,
                          torch.empty(39, 3, 16), torch.empty(39, 3, 16))  # fmt: skip
    pages = torch.empty(4, 3, 16, 16)
    for table in ([0, 1, 2], [0, 1], [0, 1, 4]):  # int64; 40 tokens in blocks of 16 need three; block 4 is not there
        table = torch.tensor(table, dtype=torch.int64 if len(table) == 3 and table[-1] == 2 else torch.int32)
        with pytest.raises(ValueError, match="int32 table of their blocks for 40 tokens"):
            cpu_decode.gather(fp.packed, fp.packed_table[0], fp.window, fp.window_table[0], 40, fp.slot, pages,
                              pages, table)  # fmt: skip
    pt, wt, k40 = fp.packed_table[0], fp.window_table[0], torch.empty(40, 3, 16)
    # a negative first token, tokens past the tables (from 9: four packed blocks), a table cut short
    for first, ptab, wtab in ((-1, pt, wt), (9, pt, wt), (0, pt[:2], wt), (0, pt, wt[:1])):
        with pytest.raises(ValueError, match=r"gather of tokens \[-?\d+, \d+\) needs a first token >= 0 and tables"):
            cpu_decode.gather(fp.packed, ptab, fp.window, wtab, 40, fp.slot, k40, k40.clone(), first=first)


@pytest.mark.parametrize(
    "dtype, fp8", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "e4m3")], ids=["fp32", "bf16", "fp8"]
)
def test_a_bound_layer_decodes_as_the_per_call_kernel(dtype, fp8, monkeypatch):
    """kernels.BoundLayer (the backend's per-layer calls, arguments set once) gives the per-call kernel's result to
    the bit: from tables and lengths with more rows than queries (vLLM's, unsliced), into a given output (fp32:
    written in place; bf16: copied) or a new tensor; with the kernel switched off it takes the PyTorch path."""
    mask = random_mask(2, 3, 64, [32, 0, 64, 7], seed=1, **EMBEDDED)
    pg = random_pages(mask, LENGTHS, q_heads=9, dtype=dtype, fp8=fp8, seed=2)
    want = run(pg, threads=2)
    torch.set_num_threads(2)
    bound = kernels.BoundLayer(pg.plan, pg.slot, pg.packed, pg.window, pg.q.dtype, 0.125, pg.k_scale, pg.v_scale,
                               pg.fp8)  # fmt: skip
    assert bound.cpu is not None and bound.cpu_write == (fp8 is None)
    more = lambda t, fill: torch.cat([t, torch.full_like(t[:1], fill)])  # noqa: E731 - a row no query reads
    tables = (more(pg.packed_table, 0), more(pg.window_table, 0), more(pg.seq_lens, 1))
    assert torch.equal(bound.decode(pg.q, *tables), want)
    out = torch.full((len(LENGTHS) + 2, 9, 64), float("nan"), dtype=dtype)
    got = bound.decode(pg.q, *tables, out[1:-1])
    assert got.data_ptr() == out[1:-1].data_ptr() and torch.equal(out[1:-1], want)
    assert out[0].isnan().all() and out[-1].isnan().all()
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    monkeypatch.setattr(cpu_decode.LayerKernel, "decode", lambda *a: pytest.fail("the kernel was called"))
    check(pg, bound.decode(pg.q, *tables), TOL[dtype])


@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_a_bound_layer_writes_as_the_per_call_write(fp8, monkeypatch):
    """BoundLayer.write puts the bytes kernels.write puts: the library's write for fp32 pages (contiguous K/V and a
    fused QKV's strided rows), the PyTorch write for fp8 pages, for rows split within a token (channels or heads
    apart), and with the kernel switched off."""
    mask = random_mask(2, 3, 16, [5, 0, 16], seed=6, align=16)
    from leank_infer.vllm.pool import WorkerPlan

    plan = WorkerPlan.build(mask, [0, 1], block_size=16)
    slot = plan.slots[1]
    store = torch.float32 if fp8 is None else torch.uint8
    packed, window = torch.zeros(6, 16, plan.packed_row, dtype=store), torch.zeros(6, 16, plan.window_row, dtype=store)
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 8 * 16, generator=g)
    fused = (qkv[:, 32:80].view(5, 3, 16), qkv[:, 80:].view(5, 3, 16))
    split = tuple(torch.randn(5, 16, 3, generator=g).transpose(1, 2) for _ in range(2))  # a token's rows apart
    padded = torch.randn(5, 3, 20, generator=g)[..., :16]  # a token's heads apart (channels contiguous)
    slots = (torch.tensor([17, -1, 40, 3, 95]), torch.tensor([20, -1, 5, 0, 90]))
    bound = kernels.BoundLayer(plan, slot, packed, window, torch.float32, 0.25, 0.5, 2.0, fp8)
    for k, v in (fused, (split[0], fused[1]), (fused[0], split[1]), (padded, fused[1]), (fused[0], padded)):
        for switch in ("1", "0"):
            monkeypatch.setenv(cpu_decode.ENV_SWITCH, switch)
            want_p, want_w = packed.clone(), window.clone()
            kernels.write(want_p, *slots[:1], want_w, *slots[1:], k, v, slot, 0.5, 2.0, fp8)
            calls: list[int] = []
            real = cpu_decode.LayerKernel.write
            monkeypatch.setattr(cpu_decode.LayerKernel, "write", lambda *a, c=calls, r=real: c.append(1) or r(*a))
            packed.zero_(), window.zero_()
            bound.write(*slots, k, v)
            assert torch.equal(packed, want_p) and torch.equal(window, want_w) and packed.any()
            assert bool(calls) == (fp8 is None and switch == "1" and k is fused[0] and v is fused[1])
            monkeypatch.setattr(cpu_decode.LayerKernel, "write", real)


def test_a_bound_layer_writes_fp32_rows_into_bf16_pages_with_the_library(monkeypatch):
    """kv_cache_dtype bfloat16 under fp32 weights: BoundLayer.write rounds the step's K/V to the pages' dtype and
    writes them with the library, the bytes kernels.write (PyTorch, which rounds the same way) puts."""
    mask = random_mask(2, 3, 16, [5, 0, 16], seed=6, align=16)
    from leank_infer.vllm.pool import WorkerPlan

    plan = WorkerPlan.build(mask, [0, 1], block_size=16)
    slot = plan.slots[1]
    packed = torch.zeros(6, 16, plan.packed_row, dtype=torch.bfloat16)
    window = torch.zeros(6, 16, plan.window_row, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, 8 * 16, generator=g)
    k, v = qkv[:, 32:80].view(5, 3, 16), qkv[:, 80:].view(5, 3, 16)  # a fused QKV's fp32 rows
    slots = (torch.tensor([17, -1, 40, 3, 95]), torch.tensor([20, -1, 5, 0, 90]))
    want_p, want_w = packed.clone(), window.clone()
    kernels.write_pages(want_p, slots[0], want_w, slots[1], k, v, slot)
    bound = kernels.BoundLayer(plan, slot, packed, window, torch.float32, 0.25)
    assert bound.cpu is not None and bound.cpu_write
    calls: list[int] = []
    real = cpu_decode.LayerKernel.write
    monkeypatch.setattr(cpu_decode.LayerKernel, "write", lambda *a: calls.append(1) or real(*a))
    bound.write(*slots, k, v)
    assert calls and packed.any() and torch.equal(packed, want_p) and torch.equal(window, want_w)
