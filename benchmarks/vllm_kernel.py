"""LeanK's CPU decode kernel against vLLM's own CPU attention kernel, one decode step's layer calls, side by side.

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_kernel.py [--batches 1,4,16,64] [--contexts 2048,8192]
        [--threads 1,2] [--mask hub/smollm2-135m-instruct-s3] [--real-rows]

The equal-work comparison: the embedded SmolLM2's shapes (9 query heads, 3 KV heads, head_dim 64, fp32), every
request at the same context, the same batch and the same threads (``torch.set_num_threads``). vLLM's column is
``ops.cpu_attention_with_kv_cache`` as ``CPUAttentionBackendImpl.forward`` calls it for decode (its scheduler
metadata built as its metadata builder does, with its ISA choice and its default split-KV), over dense pages in
shuffled blocks of 128 tokens (vLLM's CPU default); it does the same work in every layer. LeanK's column is
:func:`leank_infer.vllm.cpu_decode.decode` for every layer of the mask, over pages as the engine writes them
(window pages for the sink and window, packed rows for the rest, shuffled blocks of 16 tokens: the plugin's
default), averaged over the layers. Each figure is the median wall time of repeated calls, in microseconds per
layer call; ``x`` is vLLM's time over LeanK's (above 1: LeanK is faster).

By default each layer's packed pages hold that layer's columns only (a batch of 64 x 8k tokens of the real
30-layer rows would take 9 GB); ``--real-rows`` gives the packed rows the worker's real width (every layer's
columns side by side), as the engine has them, for the sizes that fit in memory.
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


def median_us(fn, budget_s: float = 0.4, min_reps: int = 5, max_reps: int = 200) -> float:
    """Median wall time of ``fn()`` in microseconds over as many calls as fit in ``budget_s`` (after a warm-up)."""
    fn()
    t = time.perf_counter()
    fn()
    one = time.perf_counter() - t
    reps = int(min(max_reps, max(min_reps, budget_s / max(one, 1e-6))))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
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


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python benchmarks/vllm_kernel.py", description=__doc__.splitlines()[0])
    p.add_argument("--mask", default=str(ROOT / "hub" / "smollm2-135m-instruct-s3"))
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--contexts", default="2048,8192")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--block-size", type=int, default=16, help="LeanK's page size (vLLM's stays 128)")
    p.add_argument("--real-rows", action="store_true", help="packed rows of the worker's real width")
    p.add_argument("--budget", type=float, default=0.4, help="seconds of calls per figure")
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
    g = torch.Generator().manual_seed(0)
    rows = []
    print(
        f"load {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs; mask {Path(args.mask).name}, "
        f"{len(layers)} layers; LeanK blocks of {args.block_size}, {'real' if args.real_rows else 'per-layer'} rows"
    )
    print(f"{'batch':>5} {'ctx':>6} {'thr':>3} | {'vLLM us':>9} | {'LeanK us':>9} | {'x':>5}")
    if args.real_rows:
        real = WorkerPlan.build(mask, layers, block_size=args.block_size)
        plans = {i: real for i in layers}
    else:
        plans = {i: WorkerPlan.build(mask, [i], block_size=args.block_size) for i in layers}
    widest = max(layers, key=lambda i: plans[i].packed_row)
    for context in [int(x) for x in args.contexts.split(",")]:
        for batch in [int(x) for x in args.batches.split(",")]:
            vcall, isa = vllm_call(batch, context, hkv, d, g)
            q = torch.randn(batch, HQ, d, generator=g)
            seq = torch.full((batch,), context, dtype=torch.int32)
            # one set of random pages, as wide as the widest layer's rows; each layer views its own row width
            big, table, window, wtable = leank_pages(plans[widest], batch, context, g, args.block_size)
            calls = []
            for i in layers:
                plan = plans[i]
                packed = big.view(-1)[: big.shape[0] * big.shape[1] * plan.packed_row].view(
                    big.shape[0], big.shape[1], plan.packed_row
                )
                call_args = (q, packed, table, window, wtable, seq, plan, plan.slots[i], d**-0.5)
                calls.append(lambda a=call_args: cpu_decode.decode(*a))
            for threads in [int(x) for x in args.threads.split(",")]:
                torch.set_num_threads(threads)
                t_vllm = median_us(vcall, args.budget)
                t_l = statistics.fmean(median_us(c, args.budget / 3) for c in calls)
                row = dict(
                    batch=batch, context=context, threads=threads, vllm_us=t_vllm, leank_us=t_l, isa=isa
                )
                rows.append(row)
                print(
                    f"{batch:>5} {context:>6} {threads:>3} | {t_vllm:>9.0f} | {t_l:>9.0f} | {t_vllm / t_l:>5.2f}",
                    flush=True,
                )
            del vcall, big, window, calls
    print(f"load {os.getloadavg()[0]:.2f} (1 min) at the end; vLLM ISA {rows[-1]['isa']}")
    return rows


if __name__ == "__main__":
    main()
