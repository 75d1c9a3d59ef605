"""One decode step's attention at one context: vLLM's CPU kernel vs LeanK's, layer by layer (CPU time).

    .venv-vllm/bin/python benchmarks/vllm_layer.py [--context 8192] [--batch 1] [--torch]

On the shapes of the embedded SmolLM2 (9 query heads, 3 KV heads, head_dim 64, vLLM's CPU block of
128 tokens) with random pages in shuffled blocks, every LeanK layer of the mask (``--mask``) times
vLLM's ``cpu_attention_with_kv_cache`` over dense pages and LeanK's decode over its packed pages for
``--batch`` requests of ``--context`` tokens: the fused CPU kernel (:mod:`leank_infer.vllm.cpu_kernel`)
and, with ``--torch``, the batched PyTorch path. One thread; each figure is the lower quartile of the
process CPU time of 30 calls, summed over the layers. It isolates the attention from the rest of the
step (weights, sampling), which :mod:`vllm_throughput` measures end to end.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def cpu_ms(fn, n: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return 1e3 * sorted(times)[n // 4]


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="python benchmarks/vllm_layer.py", description=__doc__.splitlines()[0])
    p.add_argument("--mask", default=str(ROOT / "hub" / "smollm2-135m-instruct"))
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--torch", action="store_true", help="also time the batched PyTorch path")
    args = p.parse_args(argv)
    from vllm import _custom_ops as ops

    from leank_infer.decode.rule import recent_from
    from leank_infer.mask import ChannelMask
    from leank_infer.vllm import cpu_kernel
    from leank_infer.vllm.layout import PackedLayout
    from leank_infer.vllm.paged_decode import paged_decode_batch

    torch.set_num_threads(1)
    if not cpu_kernel.available():
        raise SystemExit(
            "the LeanK CPU kernel is not available here (no C compiler, or LEANK_VLLM_CPU_KERNEL=0)"
        )
    mask = ChannelMask.from_pretrained(args.mask)
    b, hq, hkv, d, bs = args.batch, 9, mask.num_kv_heads, mask.head_dim, 128
    length = args.context - 1  # cached tokens before the new one
    mid_end = recent_from(
        length - 32, length, mask.recent_size, mask.accumu_size
    )  # a prompt, then 32 decoded
    n_full = mask.sink_size + length - mid_end + 1
    g = torch.Generator().manual_seed(0)
    per_req = -(-(length + 1) // bs)
    n_blocks = b * per_req + 4
    table = torch.randperm(n_blocks, generator=g)[: b * per_req].view(b, per_req).int()
    q = torch.randn(b, hq, d, generator=g)
    out = torch.empty(b, hq, d)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    seq = torch.full((b,), length + 1, dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=b, num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=seq, dtype=torch.float32,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False,
        dynamic_causal=None, kv_cache_dtype="auto",
    )  # fmt: skip
    dense = torch.randn(n_blocks, hkv, 2 * bs, d, generator=g)
    k_cache, v_cache = dense.chunk(2, dim=2)

    def plain() -> None:
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=k_cache, value_cache=v_cache, output=out, query_start_loc=qsl, seq_lens=seq,
            scale=d**-0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
            scheduler_metadata=sched, s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0,
            kv_cache_dtype="auto",
        )  # fmt: skip

    totals = {"vllm": 0.0, "leank kernel": 0.0, "leank torch": 0.0}
    layers = [i for i in range(mask.num_layers) if i not in mask.dense_layers]
    full_k = torch.randn(b, n_full, hkv, d, generator=g)
    full_v = torch.randn(b, n_full, hkv, d, generator=g)
    full_len = torch.full((b,), n_full)
    for i in layers:
        layout = PackedLayout.from_keep(mask.keep[i])
        pages = torch.randn(n_blocks, bs, layout.width, generator=g)
        inputs = (q, full_k, full_v, full_len, pages, table, mask.sink_size, [mid_end] * b, layout, d**-0.5)
        tensors = cpu_kernel.kernel_tensors(layout)
        totals["vllm"] += cpu_ms(plain)
        totals["leank kernel"] += cpu_ms(lambda: cpu_kernel.cpu_paged_decode_batch(*inputs, tensors=tensors))  # noqa: B023
        if args.torch:
            totals["leank torch"] += cpu_ms(lambda: paged_decode_batch(*inputs))  # noqa: B023
    if not args.torch:
        del totals["leank torch"]
    print(
        f"{len(layers)} LeanK layers, {b} request(s) x {args.context} tokens, 1 thread: CPU ms per step, "
        "summed over the layers: " + ", ".join(f"{k} {v:.1f}" for k, v in totals.items())
    )
    return totals


if __name__ == "__main__":
    main()
