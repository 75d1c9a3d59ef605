"""LeanK's CPU decode kernel against vLLM's own CPU attention kernel: one decode step's 30 layer calls, side by side.

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_kernel.py [--batches 1,4,16,64] [--contexts 2048,8192]
        [--threads 1,2] [--mask hub/smollm2-135m-instruct-s3] [--memory-gb 3]

The equal-work comparison: the embedded SmolLM2's shapes (9 query heads, 3 KV heads, head_dim 64, fp32), every
request at the same context, the same batch and the same threads (``torch.set_num_threads``), one decode step =
one call per layer for the 30 layers of the mask, each layer reading its own memory (as in the engine: a step
streams every layer's K/V once, so nothing stays in cache from one call of a layer to the next).

- **vLLM**: ``ops.cpu_attention_with_kv_cache`` as ``CPUAttentionBackendImpl.forward`` calls it for decode (its
  scheduler metadata built as its metadata builder does, once per step and not timed, with its ISA choice and its
  default split-KV), over dense pages in shuffled blocks of 128 tokens (vLLM's CPU default), one cache per layer
  (cycled over as many copies as ``--memory-gb`` allows).
- **LeanK**: :func:`leank_infer.vllm.cpu_decode.decode` over the pages as the plugin lays them out today
  (:mod:`leank_infer.vllm.pool`: one packed row per token holding every layer's columns, 17 KB here; window
  pages for the sink and window; shuffled blocks of 16 tokens, the plugin's default).
- **LeanK, layer-major page** (not the plugin's layout; for the lead): the same bytes per page, but inside a
  page each layer's columns of the block's tokens are one contiguous run (``[layer][token][column]``), which
  the same kernel reads through a view. It shows what the token-major row costs: a layer reads a ~0.6 KB slice
  every 17 KB, which this machine serves at a fraction of its streaming bandwidth.

Each figure is the median time of a whole step (the three alternating, so that a loaded machine disturbs them
alike), in milliseconds: CPU time of the calling thread on one thread (where every kernel runs), wall time on
more; ``x`` is vLLM's time over LeanK's (above 1: LeanK is faster). The LeanK
pools hold ``batch x context`` tokens of 17 KB: sizes past ``--memory-gb`` are left out (``-``).

Measured on the 2-core development VM (Xeon, AVX-512) at commit f44db16, load average 5.5 from other jobs (so
the 2-thread wall times say little; the 1-thread CPU times are the comparison):

    batch    ctx thr |  vLLM ms | LeanK ms     x | layer-major     x
        1   2048   1 |     13.5 |     10.7  1.26 |         7.2  1.87
        1   2048   2 |    609.9 |    326.7  1.87 |       332.0  1.84
        4   2048   1 |     52.6 |     47.0  1.12 |        31.3  1.68
        4   2048   2 |    386.4 |    372.0  1.04 |       376.0  1.03
       16   2048   1 |    202.5 |    178.1  1.14 |       120.2  1.68
       16   2048   2 |    734.1 |    714.0  1.03 |       582.1  1.26
       64   2048   1 |    804.9 |    899.4  0.89 |       539.7  1.49
       64   2048   2 |   1783.9 |   1964.0  0.91 |      1295.4  1.38
        1   8192   1 |     57.7 |     40.5  1.43 |        28.7  2.01
        1   8192   2 |    512.0 |    295.4  1.73 |       277.2  1.85
        4   8192   1 |    224.6 |    169.3  1.33 |       112.1  2.00
        4   8192   2 |    479.6 |    395.1  1.21 |       305.3  1.57
       16   8192   1 |    818.5 |    735.1  1.11 |       461.0  1.78
       16   8192   2 |   1388.7 |   1334.2  1.04 |       850.0  1.63
       64   8192   1 |        - |        -       |           -
       64   8192   2 |        - |        -       |           -
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HQ = 9


def clock() -> float:
    """The time that counts: on one thread the calling thread's CPU time (the kernels run on it; a machine shared
    with other jobs disturbs it far less than wall time), on more the wall time."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def median_us(fn, budget_s: float = 0.4, min_reps: int = 5, max_reps: int = 200) -> float:
    """Median :func:`clock` time of ``fn()`` in microseconds over as many calls as fit in ``budget_s`` (after a warm-up)."""
    fn()
    t = clock()
    fn()
    one = clock() - t
    reps = int(min(max_reps, max(min_reps, budget_s / max(one, 1e-6))))
    times = []
    for _ in range(reps):
        t = clock()
        fn()
        times.append(clock() - t)
    return 1e6 * statistics.median(times)


def vllm_call(batch: int, context: int, hkv: int, d: int, g: torch.Generator):
    """vLLM's CPU decode attention over dense pages of ``batch`` requests of ``context`` tokens, as a closure."""
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    bs = 128
    per_req = -(-context // bs)
    n_blocks = batch * per_req + 1
    table = (torch.randperm(n_blocks - 1, generator=g)[: batch * per_req] + 1).view(batch, per_req).int()
    kv = torch.randn(n_blocks, hkv, bs, 2 * d, generator=g)
    key_cache, value_cache = kv.view(n_blocks, hkv, 2 * bs, d).chunk(2, dim=2)
    q = torch.randn(batch, HQ, d, generator=g)
    out = torch.empty_like(q)
    threads = [0]
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq = torch.full((batch,), context, dtype=torch.int32)
    isa = _get_attn_isa(torch.float32, bs, d, "auto")
    sched = None

    def call() -> None:
        nonlocal sched
        if sched is None or threads[0] != torch.get_num_threads():  # once per step in vLLM: not timed
            threads[0] = torch.get_num_threads()
            sched = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=batch, num_heads=HQ, num_kv_heads=hkv, head_dim=d, seq_lens=seq, dtype=torch.float32,
                query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype="auto",
            )  # fmt: skip
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl,
            seq_lens=seq, scale=d**-0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0.0, scheduler_metadata=sched, s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0,
            kv_cache_dtype="auto",
        )  # fmt: skip

    return call, isa


def leank_pages(plan, batch: int, context: int, g: torch.Generator, bs: int = 16):
    """Packed and window pages (random, finite) of ``batch`` requests of ``context`` tokens, shuffled blocks."""
    per_req = -(-context // bs)
    n_blocks = batch * per_req + 1
    packed = torch.randn(n_blocks, bs, plan.packed_row, generator=g)
    table = (torch.randperm(n_blocks - 1, generator=g)[: batch * per_req] + 1).view(batch, per_req).int()
    # window pages: the sink's blocks and the window's, as the engine keeps them (null block 0 elsewhere)
    p = context - 1
    keep = [i for i in range(per_req) if i * bs < plan.sink or (i + 1) * bs > p - plan.window]
    w_blocks = batch * len(keep) + 1
    window = torch.randn(w_blocks, bs, plan.window_row, generator=g)
    wtable = torch.zeros(batch, per_req, dtype=torch.int32)
    ids = torch.randperm(w_blocks - 1, generator=g) + 1
    wtable[:, keep] = ids[: batch * len(keep)].view(batch, len(keep)).int()
    return packed, table, window, wtable


def layer_major(pool: torch.Tensor, plan, layer: int):  # noqa: ANN001
    """``plan``'s layer ``layer`` read from ``pool`` as if its pages were laid out layer by layer: a view
    ``[blocks, block_size, width]`` of the page's run for that layer, and a slot starting at column 0."""
    import dataclasses

    slot = plan.slots[layer]
    nb, bs, row = pool.shape
    view = torch.as_strided(
        pool, (nb, bs, slot.packed_width), (pool.stride(0), slot.packed_width, 1),
        pool.storage_offset() + bs * slot.packed_offset,
    )  # fmt: skip
    return view, dataclasses.replace(slot, packed_offset=0)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python benchmarks/vllm_kernel.py", description=__doc__.splitlines()[0])
    p.add_argument("--mask", default=str(ROOT / "hub" / "smollm2-135m-instruct-s3"))
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--contexts", default="2048,8192")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--block-size", type=int, default=16, help="LeanK's page size (vLLM's stays 128)")
    p.add_argument("--memory-gb", type=float, default=3.0, help="the most each side's pages may take")
    p.add_argument("--steps", type=int, default=7, help="timed steps per figure (after one warm-up)")
    args = p.parse_args(argv)
    from leank_infer.mask import ChannelMask
    from leank_infer.vllm import cpu_decode
    from leank_infer.vllm.pool import WorkerPlan

    if not cpu_decode.available():
        raise SystemExit(
            "the LeanK CPU kernel is not available here (no C++ compiler, or LEANK_VLLM_CPU_KERNEL=0)"
        )
    mask = ChannelMask.from_pretrained(args.mask)
    hkv, d = mask.num_kv_heads, mask.head_dim
    layers = [i for i in range(mask.num_layers) if i not in mask.dense_layers]
    plan = WorkerPlan.build(mask, layers, block_size=args.block_size)
    g = torch.Generator().manual_seed(0)
    rows = []
    print(
        f"load {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs; mask {Path(args.mask).name}, "
        f"{len(layers)} layers, packed row {plan.packed_row * 4} B; LeanK blocks of {args.block_size}"
    )
    print(
        f"{'batch':>5} {'ctx':>6} {'thr':>3} | {'vLLM ms':>8} | {'LeanK ms':>8} {'x':>5} | {'layer-major':>11} {'x':>5}"
    )
    budget = args.memory_gb * 2**30
    for context in [int(x) for x in args.contexts.split(",")]:
        for batch in [int(x) for x in args.batches.split(",")]:
            tokens = batch * context
            if tokens * plan.packed_row * 4 > budget:
                for threads in [int(x) for x in args.threads.split(",")]:
                    print(f"{batch:>5} {context:>6} {threads:>3} | {'-':>8} | {'-':>8} {'':>5} | {'-':>11}")
                continue
            copies = int(max(1, min(len(layers), budget // (tokens * 2 * hkv * d * 4))))
            vcalls = [vllm_call(batch, context, hkv, d, g) for _ in range(copies)]
            isa = vcalls[0][1]
            q = torch.randn(batch, HQ, d, generator=g)
            seq = torch.full((batch,), context, dtype=torch.int32)
            packed, table, window, wtable = leank_pages(plan, batch, context, g, args.block_size)
            today = [(q, packed, table, window, wtable, seq, plan, plan.slots[i], d**-0.5) for i in layers]
            major = []
            for i in layers:
                view, slot = layer_major(packed, plan, i)
                major.append((q, view, table, window, wtable, seq, plan, slot, d**-0.5))

            def vllm_step(vcalls=vcalls) -> None:
                for j in range(len(layers)):
                    vcalls[j % len(vcalls)][0]()

            def leank_step(calls) -> None:  # noqa: ANN001
                for a in calls:
                    cpu_decode.decode(*a)

            for threads in [int(x) for x in args.threads.split(",")]:
                torch.set_num_threads(threads)
                steps = {
                    "vllm": vllm_step,
                    "today": lambda t=today: leank_step(t),
                    "major": lambda m=major: leank_step(m),
                }
                times: dict[str, list[float]] = {k: [] for k in steps}
                for k in steps.values():
                    k()  # warm-up (and vLLM's scheduler metadata for this thread count)
                for _ in range(args.steps):
                    for k, fn in steps.items():
                        t = clock()
                        fn()
                        times[k].append(1e3 * (clock() - t))
                med = {k: statistics.median(v) for k, v in times.items()}
                row = dict(
                    batch=batch,
                    context=context,
                    threads=threads,
                    isa=isa,
                    **{f"{k}_ms": v for k, v in med.items()},
                )
                rows.append(row)
                print(
                    f"{batch:>5} {context:>6} {threads:>3} | {med['vllm']:>8.1f} | {med['today']:>8.1f} "
                    f"{med['vllm'] / med['today']:>5.2f} | {med['major']:>11.1f} {med['vllm'] / med['major']:>5.2f}",
                    flush=True,
                )
            del vcalls, packed, window, today, major
    print(f"load {os.getloadavg()[0]:.2f} (1 min) at the end; vLLM ISA {rows[-1]['isa'] if rows else '?'}")
    return rows


if __name__ == "__main__":
    main()
