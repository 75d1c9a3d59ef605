"""The vLLM plugin's CPU decode kernel over an HF-style sequence against the HF path's decode attention.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/vllm_kernel_hf.py [--contexts 2048,8192] [--batches 1,4]
        [--threads 1,2] [--mask hub/smollm2-135m-instruct-s3]

For the question whether the transformers path could call the same kernel: per decode step and all 30 layers
of the embedded SmolLM2's shapes (9 query heads, 3 KV heads, head_dim 64, fp32), the HF path as ``leank
generate``/``leank bench`` run it (``LeanKLayer.update`` of the new token, then the ``"leank"`` attention:
:mod:`leank_infer.decode.torch_decode`'s fast path, as ``benchmarks/decode_layer.py`` times it) against
:func:`leank_infer.vllm.cpu_decode.decode` over pages where each request's tokens are one contiguous run
(block table ``0..n-1`` from its first block, blocks of 16: what an HF sequence would look like), the new
token already written; and the kernel over per-layer stores (each layer's packed rows alone, one contiguous run:
the layout an HF cache would give it, "own rows"). Median of repeated steps, milliseconds per step: CPU time of the calling thread on one
thread, wall time on more.

Measured on the 2-core development VM (Xeon, AVX-512) at commit 0d715fc, one thread (CPU time), load average
3.4-4.2 from other jobs (the 2-thread wall times of an earlier run at load 3-4 were 5-15x the 1-thread ones
for the HF path: meaningless; not repeated):

    batch    ctx thr |   HF ms | kernel ms     x |  own rows     x
        1   2048   1 |   12.85 |      8.90  1.44 |      7.39  1.74
        4   2048   1 |   31.50 |     42.81  0.74 |     28.08  1.12
        1   8192   1 |   31.32 |     39.90  0.79 |     26.67  1.17
        4   8192   1 |   87.70 |    234.79  0.37 |    108.45  0.81
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
HQ, HKV, D = 9, 3, 64


class _Attn(nn.Module):
    is_causal = True
    num_key_value_groups = HQ // HKV


def clock() -> float:
    """CPU time of the calling thread on one thread (less disturbed by other jobs), else wall time."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = clock()
        fn()
        times.append(clock() - t)
    return 1e3 * statistics.median(times)


def measure(mask, plan, ctx: int, batch: int, threads: str, steps: int, g: torch.Generator) -> list:  # noqa: ANN001
    """(threads, HF ms, kernel ms) per step for each thread count."""
    from leank_infer.decode.attention import leank_attention_forward
    from leank_infer.decode.cache import LeanKLayer
    from leank_infer.vllm import cpu_decode

    layers = list(range(mask.num_layers))
    # HF: the cache after a prefill of ctx - 1 tokens; each timed step adds one token and attends
    k0, v0 = (torch.randn(batch, HKV, ctx - 1, D, generator=g) for _ in range(2))
    q, k1, v1 = (torch.randn(batch, h, 1, D, generator=g) for h in (HQ, HKV, HKV))
    module = _Attn()

    def hf_step(cache: list) -> None:
        for layer in cache:
            kw: dict = {}
            kk, vv = layer.update(k1, v1, kwargs=kw)
            leank_attention_forward(module, q, kk, vv, None, scaling=D**-0.5, **kw)

    # kernel: every request one contiguous run of blocks, in the real 30-layer rows
    per_req = -(-ctx // 16)
    packed = torch.randn(batch * per_req + 1, 16, plan.packed_row, generator=g)
    window = torch.randn(batch * per_req + 1, 16, plan.window_row, generator=g)
    table = (1 + torch.arange(batch * per_req, dtype=torch.int32)).view(batch, per_req)
    seq = torch.full((batch,), ctx, dtype=torch.int32)
    qk = q[:, :, 0].contiguous()

    def kernel_step() -> None:
        for i in layers:
            cpu_decode.decode(qk, packed, table, window, table, seq, plan, plan.slots[i], D**-0.5)

    # kernel over per-layer stores (each layer's packed rows alone, contiguous: the HF cache's own layout)
    from leank_infer.vllm.pool import WorkerPlan

    own = []
    window1 = torch.randn(batch * per_req + 1, 16, 2 * HKV * D, generator=g)  # one layer's rest rows (room for any)
    for i in layers:
        p1 = WorkerPlan.build(mask, [i], block_size=16)
        pk = torch.randn(batch * per_req + 1, 16, p1.packed_row, generator=g)
        own.append((qk, pk, table, window1, table, seq, p1, p1.slots[i], D**-0.5))

    def own_step() -> None:
        for a in own:
            cpu_decode.decode(*a)

    rows = []
    for t in (int(x) for x in threads.split(",")):
        torch.set_num_threads(t)
        hf = []
        for _ in range(steps):  # a fresh cache per step: every step sees ctx tokens
            cache = [
                LeanKLayer(mask.keep[i], mask.sink_size, mask.recent_size, mask.accumu_size) for i in layers
            ]
            for layer in cache:
                layer.update(k0, v0, kwargs={})
            start = clock()
            hf_step(cache)
            hf.append(clock() - start)
        rows.append(
            (t, 1e3 * statistics.median(hf), median_ms(kernel_step, steps), median_ms(own_step, steps))
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python benchmarks/vllm_kernel_hf.py", description=__doc__.splitlines()[0]
    )
    p.add_argument("--mask", default=str(ROOT / "hub" / "smollm2-135m-instruct-s3"))
    p.add_argument("--contexts", default="2048,8192")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args(argv)
    from leank_infer.mask import ChannelMask
    from leank_infer.vllm import cpu_decode
    from leank_infer.vllm.pool import WorkerPlan

    assert cpu_decode.available()
    mask = ChannelMask.from_pretrained(args.mask)
    plan = WorkerPlan.build(mask, list(range(mask.num_layers)), block_size=16)
    print(f"load {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs; mask {Path(args.mask).name}")
    print(
        f"{'batch':>5} {'ctx':>6} {'thr':>3} | {'HF ms':>7} | {'kernel ms':>9} {'x':>5} | {'own rows':>9} {'x':>5}"
    )
    g = torch.Generator().manual_seed(0)
    for ctx in (int(x) for x in args.contexts.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            for threads, t_hf, t_k, t_o in measure(mask, plan, ctx, batch, args.threads, args.steps, g):
                print(
                    f"{batch:>5} {ctx:>6} {threads:>3} | {t_hf:>7.2f} | {t_k:>9.2f} {t_hf / t_k:>5.2f} | "
                    f"{t_o:>9.2f} {t_hf / t_o:>5.2f}",
                    flush=True,
                )
    print(f"load {os.getloadavg()[0]:.2f} (1 min) at the end")


if __name__ == "__main__":
    main()
