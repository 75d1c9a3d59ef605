"""LeanK's CPU decode kernel against vLLM's own CPU attention kernel: one decode step's 30 layer calls, side by side.

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_kernel.py [--batches 1,4,16,64] [--contexts 2048,8192]
        [--threads 1,2] [--mask hub/smollm2-135m-instruct-s3] [--memory-gb 3] [--gather 3000]
        [--prompt 4x512@2560,1x3000@0] [--drafts 4x4@2048,...]

The equal-work comparison: the embedded SmolLM2's shapes (9 query heads, 3 KV heads, head_dim 64, fp32), every
request at the same context, the same batch and the same threads (``torch.set_num_threads``), one decode step =
one call per layer for the 30 layers of the mask, each layer reading its own memory (as in the engine: a step
streams every layer's K/V once, so nothing stays in cache from one call of a layer to the next).

- **vLLM**: ``ops.cpu_attention_with_kv_cache`` as ``CPUAttentionBackendImpl.forward`` calls it for decode (its
  scheduler metadata built as its metadata builder does, once per step and not timed, with its ISA choice and its
  default split-KV), over dense pages in shuffled blocks of 128 tokens (vLLM's CPU default), one cache per layer
  (cycled over as many copies as ``--memory-gb`` allows).
- **LeanK**: :meth:`leank_infer.vllm.cpu_decode.LayerKernel.decode`, each layer's call bound once as the engine's
  backend binds it, over the pages as the plugin lays them out
  (:mod:`leank_infer.vllm.pool`: inside each page, every layer's packed rows are one run, then the window pages of
  the sink and the window; shuffled blocks), each layer through its own views. The block sizes are the plugin's on
  CPU under the default rule (``-s3``: 40-token packed pages, 24-token window pages), or ``--block-size`` and the
  window block the plugin picks for it.

- **prompt step** (``--prompt BxC@N,...``): the prompt attention of a step of ``B`` chunks of ``C`` queries after
  ``N`` prompt tokens each, every layer: plain vLLM's, the plugin's on the CPU build (its page write included)
  (:func:`leank_infer.vllm.cpu_prefill.attend`) and the per-request SDPA path (:func:`prompt_times`).
- **speculative step** (``--drafts BxQ@C,...``, alone): ``B`` requests of ``C`` tokens each scoring ``Q`` queries
  (its token and its drafts): vLLM's kernel over causal chunks, LeanK's decode with a row per query, each alone and
  each request's rows as one run (:func:`draft_times`).
- **prompt gather** (``--gather N``): the dense K/V a prompt chunk after ``N`` prompt tokens reads under the
  dense-prompt rule, every layer, PyTorch's gather against the library's (:func:`leank_infer.vllm.kernels.prompt_kv`).

Each figure is the median time of a whole step (the two alternating, so that a loaded machine disturbs them
alike), in milliseconds: CPU time of the calling thread on one thread (where every kernel runs), wall time on
more; ``x`` is vLLM's time over LeanK's (above 1: LeanK is faster). Sizes whose pages would pass
``--memory-gb`` are left out (``-``). The measured table is in docs/vllm.md with the command and the load.
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


def alternate(sides: dict, reps: int) -> dict[str, float]:
    """Median :func:`clock` milliseconds of each side's call over ``reps`` rounds, after one warm-up call each; in a
    round the sides run one after the other, so that a loaded machine slows them alike."""
    times: dict[str, list[float]] = {k: [] for k in sides}
    for fn in sides.values():
        fn()
    for _ in range(reps):
        for k, fn in sides.items():
            t = clock()
            fn()
            times[k].append(1e3 * (clock() - t))
    return {k: statistics.median(v) for k, v in times.items()}


def vllm_call(batch: int, context: int, hkv: int, d: int, g: torch.Generator, queries: int = 1):
    """vLLM's CPU decode attention over dense pages of ``batch`` requests of ``context`` tokens, as a closure
    (``queries`` > 1: each request's last ``queries`` positions, causal, as vLLM scores speculative drafts)."""
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    bs = 128
    per_req = -(-context // bs)
    n_blocks = batch * per_req + 1
    table = (torch.randperm(n_blocks - 1, generator=g)[: batch * per_req] + 1).view(batch, per_req).int()
    kv = torch.randn(n_blocks, hkv, bs, 2 * d, generator=g)
    key_cache, value_cache = kv.view(n_blocks, hkv, 2 * bs, d).chunk(2, dim=2)
    q = torch.randn(batch * queries, HQ, d, generator=g)
    out = torch.empty_like(q)
    threads = [0]
    qsl = torch.arange(batch + 1, dtype=torch.int32) * queries
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


def vllm_copies(tokens: int, hkv: int, d: int, layers: int, budget: float) -> int:
    """How many copies of vLLM's fp32 pages for ``tokens`` tokens the layers cycle over: one per layer where
    ``budget`` bytes allow, so that a layer's call does not find the last one's K/V in cache, as in the engine."""
    return int(max(1, min(layers, budget // (tokens * 2 * hkv * d * 4))))


def leank_pages(plan, batch: int, context: int, g: torch.Generator, lookback: int = 0):
    """The packed and window stores' caches (random, finite; ``[blocks, 1, block_size, row]`` as vLLM binds
    them, at the plan's block sizes) of ``batch`` requests of ``context`` tokens, shuffled blocks, with their block
    tables (``lookback``: the window pages also cover the window of the query that many positions back)."""
    bs = plan.block_size
    per_req = -(-context // bs)
    n_blocks = batch * per_req + 1
    packed = torch.randn(n_blocks, 1, bs, plan.packed_row, generator=g)
    table = (torch.randperm(n_blocks - 1, generator=g)[: batch * per_req] + 1).view(batch, per_req).int()
    # window pages (of the plan's own block size): the sink's blocks and the window's, as the engine keeps them (null
    # block 0 elsewhere)
    p, wbs = context - 1, plan.window_block
    per_win = -(-context // wbs)
    keep = [i for i in range(per_win) if i * wbs < plan.sink or (i + 1) * wbs > p - lookback - plan.window]
    w_blocks = batch * len(keep) + 1
    window = torch.randn(w_blocks, 1, wbs, plan.window_row, generator=g)
    wtable = torch.zeros(batch, per_win, dtype=torch.int32)
    ids = torch.randperm(w_blocks - 1, generator=g) + 1
    wtable[:, keep] = ids[: batch * len(keep)].view(batch, len(keep)).int()
    return packed, table, window, wtable


def draft_times(
    plan, layers: list[int], batch: int, queries: int, context: int, g: torch.Generator, budget: float, steps: int  # noqa: ANN001
) -> dict:
    """One speculative step's attention, every layer: ``batch`` requests of ``context`` tokens, each scoring its last
    ``queries`` positions (its token and its drafts). vLLM's kernel takes them as causal chunks, over as many copies of
    its pages as ``budget`` bytes allow (as in the decode table: a layer's call should not find the last one's K/V in
    cache); LeanK's decode takes a row per query, each row alone (every query reads its middle) and as one run per
    request (the middle they share read once: ``runs``)."""
    from leank_infer.vllm import cpu_decode

    hkv, d = plan.num_kv_heads, plan.head_dim
    copies = vllm_copies(batch * context, hkv, d, len(layers), budget)
    vcalls = [vllm_call(batch, context, hkv, d, g, queries)[0] for _ in range(copies)]
    packed, table, window, wtable = leank_pages(plan, batch, context, g, lookback=queries - 1)
    rows = torch.arange(batch).repeat_interleave(queries)
    seq = (torch.full((batch * queries,), context) - torch.arange(queries - 1, -1, -1).repeat(batch)).int()
    q = torch.randn(batch * queries, HQ, d, generator=g)
    leank = [
        cpu_decode.LayerKernel(s.in_view(), s.packed_view(packed), s.window_view(window), plan, d**-0.5)
        for s in (plan.slots[i] for i in layers)
    ]
    alone = (q, table[rows], wtable[rows], seq)
    runs = cpu_decode.runs_of([queries] * batch)
    sides = {
        "vllm": lambda: [vcalls[j % copies]() for j in range(len(layers))],
        "alone": lambda: [layer.decode(*alone) for layer in leank],
        "runs": lambda: [layer.decode(*alone, runs=runs) for layer in leank],
    }
    med = alternate(sides, steps)
    return dict(batch=batch, queries=queries, context=context, threads=torch.get_num_threads(),
                **{f"{k}_ms": v for k, v in med.items()})  # fmt: skip


def gather_times(plan, layers: list[int], n: int, g: torch.Generator) -> tuple[float, float]:  # noqa: ANN001
    """Milliseconds (median, calling thread's CPU time on one thread) of one request's dense K/V for a prompt chunk
    after ``n`` prompt tokens, every layer: PyTorch's gather, then the library's, alternating."""
    from leank_infer.vllm import kernels
    from leank_infer.vllm.paged_reference import request_kv

    torch.set_num_threads(1)
    packed, table, _, _ = leank_pages(plan, 1, n + 16, g)
    window = torch.randn(packed.shape[0], 1, packed.shape[2], plan.window_row, generator=g)  # every block real
    new = torch.randn(16, plan.num_kv_heads, plan.head_dim, generator=g)
    calls = [(s.in_view(), s.packed_view(packed), s.window_view(window)) for s in (plan.slots[i] for i in layers)]
    args = lambda c: (plan, c[0], c[1], table[0], c[2], table[0], n + 16, n, new, new, torch.float32)  # noqa: E731
    sides = {
        "torch": lambda: [request_kv(*args(c), whole=True) for c in calls],
        "library": lambda: [kernels.prompt_kv(*args(c)) for c in calls],
    }
    med = alternate(sides, 7)
    out = (med["torch"], med["library"])
    print(f"prompt gather of {n} tokens, {len(layers)} layers: PyTorch {out[0]:.1f} ms, library {out[1]:.1f} ms")
    return out


def prompt_times(plan, layers: list[int], batch: int, chunk: int, cached: int, g: torch.Generator) -> dict:  # noqa: ANN001
    """Milliseconds (median of alternating steps, :func:`clock`) of the prompt attention of one step over every layer:
    ``batch`` requests, each a chunk of ``chunk`` prompt queries after ``cached`` prompt tokens. **vLLM**: plain vLLM's
    write of the chunks' K/V and its CPU attention over dense pages (blocks of 128); **LeanK**: the plugin's write of
    the chunks' K/V into its pages, then :func:`leank_infer.vllm.cpu_prefill.attend` (the gather into a scratch of
    vLLM's pages, then the same kernel), the step's plan included;
    **SDPA**: the per-request path that runs on CUDA (:func:`~leank_infer.vllm.kernels.prompt_kv`, then
    :func:`~leank_infer.vllm.kernels.dense_prefill`), on the same pages."""
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from leank_infer.vllm import cpu_prefill, kernels

    hkv, d, length, n = plan.num_kv_heads, plan.head_dim, cached + chunk, batch * chunk
    q = torch.randn(n, HQ, d, generator=g)
    k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    out = torch.empty_like(q)
    # plain vLLM: dense pages per layer, the earlier tokens in place, the chunks written by the step
    bs, per_req = 128, -(-length // 128)
    table = (torch.randperm(batch * per_req, generator=g) + 1).view(batch, per_req).int()
    caches = [torch.randn(batch * per_req + 1, hkv, 2 * bs, d, generator=g).chunk(2, dim=2) for _ in layers]
    pos = torch.arange(cached, length)
    slots = torch.cat([table[b].long()[pos // bs] * bs + pos % bs for b in range(batch)])
    qsl = torch.arange(0, n + 1, chunk, dtype=torch.int32)
    seq = torch.full((batch,), length, dtype=torch.int32)
    isa = _get_attn_isa(torch.float32, bs, d, "auto")
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch, num_heads=HQ, num_kv_heads=hkv, head_dim=d, seq_lens=seq, dtype=torch.float32,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype="auto",
    )  # fmt: skip

    def vllm_step() -> None:
        for key_cache, value_cache in caches:
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl,
                seq_lens=seq, scale=d**-0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
                softcap=0.0, scheduler_metadata=sched, s_aux=None, dynamic_causal=None,
            )  # fmt: skip

    # LeanK: the plugin's pages, every prompt block's rest row real (the dense-prompt rule while it is computed), the
    # window pages at the plan's own block size; a step writes the chunks' K/V into them first, as the engine does
    packed, ptable, _, _ = leank_pages(plan, batch, length, g)
    wbs = plan.window_block
    per_win = -(-length // wbs)
    window = torch.randn(batch * per_win + 1, 1, wbs, plan.window_row, generator=g)
    wtable = (torch.randperm(batch * per_win, generator=g) + 1).view(batch, per_win).int()
    pslots = torch.cat([ptable[b].long()[pos // plan.block_size] * plan.block_size + pos % plan.block_size
                        for b in range(batch)])  # fmt: skip
    wslots = torch.cat([wtable[b].long()[pos // wbs] * wbs + pos % wbs for b in range(batch)])
    bound = [
        kernels.BoundLayer(plan, s.in_view(), s.packed_view(packed), s.window_view(window), torch.float32, d**-0.5)
        for s in (plan.slots[i] for i in layers)
    ]
    chunks = [(b, b * chunk, (b + 1) * chunk, cached) for b in range(batch)]

    def leank_step() -> None:
        batch_plan = cpu_prefill.plan_prompts(chunks, ptable, plan.block_size, HQ, hkv, d, torch.float32)  # a step's
        for layer in bound:
            layer.write(pslots, wslots, k, v)
            cpu_prefill.attend(batch_plan, layer, q, k, v, out, ptable, wtable)

    def sdpa_step() -> None:
        for layer in bound:
            for b, start, end, first in chunks:
                kk, vv = kernels.prompt_kv(
                    plan, layer.slot, layer.packed, ptable[b], layer.window, wtable[b], length, first, k[start:end],
                    v[start:end], torch.float32,
                )  # fmt: skip
                out[start:end] = kernels.dense_prefill(q[start:end], kk, vv, first, d**-0.5)

    med = {f"{k}_ms": t for k, t in alternate({"vllm": vllm_step, "leank": leank_step, "sdpa": sdpa_step}, 5).items()}
    print(
        f"prompt step, {batch} x {chunk} queries after {cached}, {len(layers)} layers, {torch.get_num_threads()} "
        f"thread(s): vLLM {med['vllm_ms']:.1f} ms, LeanK {med['leank_ms']:.1f} ms, SDPA {med['sdpa_ms']:.1f} ms",
        flush=True,
    )
    return dict(batch=batch, chunk=chunk, cached=cached, threads=torch.get_num_threads(), **med)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python benchmarks/vllm_kernel.py", description=__doc__.splitlines()[0])
    p.add_argument("--mask", default=str(ROOT / "hub" / "smollm2-135m-instruct-s3"))
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--contexts", default="2048,8192")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--block-size", type=int, default=None,
                   help="LeanK's packed block (default: the plugin's pick on CPU; vLLM's pages stay 128 tokens)")
    p.add_argument("--memory-gb", type=float, default=3.0, help="the most each side's pages may take")
    p.add_argument("--steps", type=int, default=7, help="timed steps per figure (after one warm-up)")
    p.add_argument("--gather", type=int, default=3000,
                   help="also time a prompt chunk's gather of this many earlier tokens over every layer (0: no)")
    p.add_argument("--prompt", default="4x512@2560,1x3000@0",
                   help="also time prompt steps: BATCH x CHUNK queries after CACHED prompt tokens each, comma-separated "
                   "('': no)")
    p.add_argument("--drafts", default="",
                   help="BxQ@C,...: instead, one speculative step of B requests of C tokens scoring Q queries each "
                        "(saved as vllm-kernel-drafts)")  # fmt: skip
    p.add_argument("--save", action="store_true", help="write the table to docs/results/vllm-kernel.json")
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
    plan = WorkerPlan.build(  # as the plugin plans a CPU worker under the default rule (hits at most vLLM's 128)
        mask, layers, block_size=args.block_size or 16, dense_prompt=True, prefix_align=args.block_size or 128,
        fit_packed=args.block_size is None,
    )
    g = torch.Generator().manual_seed(0)
    rows = []
    print(
        f"load {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs; mask {Path(args.mask).name}, "
        f"{len(layers)} layers, packed row {plan.packed_row * 4} B; LeanK blocks of {plan.block_size} (packed) and "
        f"{plan.window_block} (window)"
    )
    if args.drafts:
        return drafts(args, plan, layers, g)
    print(f"{'batch':>5} {'ctx':>6} {'thr':>3} | {'vLLM ms':>8} | {'LeanK ms':>8} {'x':>5}")
    budget = args.memory_gb * 2**30
    for context in [int(x) for x in args.contexts.split(",")]:
        for batch in [int(x) for x in args.batches.split(",")]:
            tokens = batch * context
            if tokens * plan.packed_row * 4 > budget:
                for threads in [int(x) for x in args.threads.split(",")]:
                    print(f"{batch:>5} {context:>6} {threads:>3} | {'-':>8} | {'-':>8}")
                continue
            copies = vllm_copies(tokens, hkv, d, len(layers), budget)
            vcalls = [vllm_call(batch, context, hkv, d, g) for _ in range(copies)]
            isa = vcalls[0][1]
            q = torch.randn(batch, HQ, d, generator=g)
            seq = torch.full((batch,), context, dtype=torch.int32)
            packed, table, window, wtable = leank_pages(plan, batch, context, g)
            leank = [  # each layer's calls bound once, as the engine's backend binds them
                cpu_decode.LayerKernel(s.in_view(), s.packed_view(packed), s.window_view(window), plan, d**-0.5)
                for s in (plan.slots[i] for i in layers)
            ]

            def vllm_step(vcalls=vcalls) -> None:
                for j in range(len(layers)):
                    vcalls[j % len(vcalls)][0]()

            def leank_step(calls, inputs) -> None:  # noqa: ANN001
                for layer in calls:
                    layer.decode(*inputs)

            for threads in [int(x) for x in args.threads.split(",")]:
                torch.set_num_threads(threads)
                steps = {"vllm": vllm_step, "leank": lambda c=leank, i=(q, table, wtable, seq): leank_step(c, i)}
                med = alternate(steps, args.steps)  # the warm-up builds vLLM's scheduler metadata for these threads
                row = dict(
                    batch=batch,
                    context=context,
                    threads=threads,
                    isa=isa,
                    **{f"{k}_ms": v for k, v in med.items()},
                )
                rows.append(row)
                print(
                    f"{batch:>5} {context:>6} {threads:>3} | {med['vllm']:>8.1f} | {med['leank']:>8.1f} "
                    f"{med['vllm'] / med['leank']:>5.2f}",
                    flush=True,
                )
            del vcalls, packed, window, leank
    prompts = []
    for spec in filter(None, args.prompt.split(",")):
        shape, cached = spec.split("@")
        pb, pc = (int(x) for x in shape.split("x"))
        for threads in [int(x) for x in args.threads.split(",")]:
            torch.set_num_threads(threads)
            prompts.append(prompt_times(plan, layers, pb, pc, int(cached), g))
    gathered = gather_times(plan, layers, args.gather, g) if args.gather else None
    print(f"load {os.getloadavg()[0]:.2f} (1 min) at the end; vLLM ISA {rows[-1]['isa'] if rows else '?'}")
    lines = [
        f"One decode step (30 layer calls), mask {Path(args.mask).name}, fp32, milliseconds: CPU time of the thread "
        "on 1 thread, wall time on more; x = vLLM's time over LeanK's.",
        "",
        "| batch | context | threads | vLLM's kernel (ms) | LeanK's kernel (ms) | x |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['batch']} | {r['context']} | {r['threads']} | {r['vllm_ms']:.1f} | {r['leank_ms']:.1f} | "
            f"{r['vllm_ms'] / r['leank_ms']:.2f} |"
            for r in rows
        ),
    ]
    if prompts:
        lines += [
            "",
            f"The prompt attention of one step, all {len(layers)} layers: requests x a chunk of prompt queries each, "
            "after cached prompt tokens (the dense-prompt rule), milliseconds as above. vLLM: plain vLLM's write and "
            "CPU attention over its pages; LeanK: the plugin's (its page write, then `cpu_prefill.attend`: the gather "
            "into a scratch of vLLM's pages, the chunks' own K/V put there, then vLLM's kernel); SDPA: the per-request "
            "gather and SDPA (`kernels.prompt_kv`, `kernels.dense_prefill`; what CUDA runs) over the same pages.",
            "",
            "| step | threads | vLLM (ms) | LeanK (ms) | SDPA (ms) | LeanK / vLLM | SDPA / LeanK |",
            "|---|---|---|---|---|---|---|",
            *(
                f"| {r['batch']} x {r['chunk']:,} after {r['cached']:,} | {r['threads']} | {r['vllm_ms']:.1f} | "
                f"{r['leank_ms']:.1f} | {r['sdpa_ms']:.1f} | {r['leank_ms'] / r['vllm_ms']:.2f} | "
                f"{r['sdpa_ms'] / r['leank_ms']:.2f} |"
                for r in prompts
            ),
        ]
    if gathered:
        lines += [
            "",
            f"A prompt chunk's gather of {args.gather:,} earlier prompt tokens with every channel (the dense-prompt "
            f"rule), all {len(layers)} layers, one thread: PyTorch (`paged_reference.request_kv(..., whole=True)`) "
            f"{gathered[0]:.1f} ms, the kernel's library (`kernels.prompt_kv`) {gathered[1]:.1f} ms.",
        ]
    if args.save:
        import results

        print(f"saved {results.save('vllm-kernel', chr(10).join(lines))}")
    return rows


def drafts(args: argparse.Namespace, plan, layers: list[int], g: torch.Generator) -> list[dict]:  # noqa: ANN001
    """The ``--drafts`` table: :func:`draft_times` for each size and thread count."""
    rows = []
    print(f"{'step':>14} {'thr':>3} | {'vLLM ms':>8} | {'alone ms':>8} {'runs ms':>8}")
    for spec in filter(None, args.drafts.split(",")):
        shape, context = spec.split("@")
        batch, queries = (int(x) for x in shape.split("x"))
        for threads in [int(x) for x in args.threads.split(",")]:
            torch.set_num_threads(threads)
            r = draft_times(plan, layers, batch, queries, int(context), g, args.memory_gb * 2**30, args.steps)
            rows.append(r)
            print(f"{spec:>14} {threads:>3} | {r['vllm_ms']:>8.1f} | {r['alone_ms']:>8.1f} {r['runs_ms']:>8.1f}", flush=True)
    lines = [
        f"One speculative step's attention ({len(layers)} layer calls), mask {Path(args.mask).name}, fp32: requests x "
        "queries per request (its token and its drafts) at a context, milliseconds (CPU time of the thread on 1 thread, "
        "wall time on more). vLLM: its CPU kernel, the queries as causal chunks; LeanK: its decode kernel, a row per "
        "query, each row alone or each request's rows as one run (the middle they share read once).",
        "",
        "| step | threads | vLLM (ms) | LeanK, rows alone (ms) | LeanK, runs (ms) | runs / alone | runs / vLLM |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['batch']} x {r['queries']} at {r['context']:,} | {r['threads']} | {r['vllm_ms']:.1f} | "
            f"{r['alone_ms']:.1f} | {r['runs_ms']:.1f} | {r['runs_ms'] / r['alone_ms']:.2f} | "
            f"{r['runs_ms'] / r['vllm_ms']:.2f} |"
            for r in rows
        ),
    ]
    if args.save:
        import results

        print(f"saved {results.save('vllm-kernel-drafts', chr(10).join(lines))}")
    return rows


if __name__ == "__main__":
    main()
