"""Does each CPU implementation of LeanK attention earn its place? Each one against what would run without it.

The implementation map in docs/architecture.md keeps an implementation only where it serves a path no other can,
by capability or by speed. The speed cases, each pair on the same inputs, alternating, best of three, the main
thread's CPU time on one torch thread (a CPU shared with other jobs disturbs it far less than wall time), random
K/V of the embedded SmolLM2-135M's shapes (9 query / 3 KV heads, head_dim 64) and the committed mask's channels:

- ``decode``: ``torch_decode``'s fused path (one query per row, no padding, fp32 CPU) against its general path
  (what would run without it), one decode step over the 30 layers (``LeanKLayer.update`` + the ``"leank"``
  attention, as benchmarks/decode_layer.py);
- ``quant``: the kv_quant middle read by ``torch_decode``'s PyTorch products (``LEANK_CPU_KERNEL=0``: the path
  where no C++ compiler works) against dequantising the middle and taking the fused path;
- ``prefill``: the positional prefill of one layer (``positional_prefill``) without soft-capping, its SDPA path
  against its explicit-scores path; with soft-capping (Gemma 2), its scores path against the training reference
  ``masked_attention.leank_attention`` (both compute the same rule: the largest difference is printed).

    python benchmarks/implementations.py [--contexts 1024,4096] [--batches 1,4] [--only decode,quant,prefill]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
from decode_layer import HKV, HQ, D, _Attn

from leank_infer.decode import positional_prefill, quant_cpu, torch_decode
from leank_infer.decode.attention import leank_attention_forward
from leank_infer.decode.cache import LeanKLayer
from leank_infer.decode.masked_attention import leank_attention
from leank_infer.mask import ChannelMask

ROUNDS = 3


def best_ms(variants: dict[str, Callable[[], Callable[[], object]]], per: int = 1) -> dict[str, float]:
    """Best CPU time (ms, divided by ``per``) of each variant over :data:`ROUNDS` rounds, the variants alternating
    within a round; a variant is a setup (not timed) returning what is timed."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(ROUNDS):
        for name, setup in variants.items():
            fn = setup()
            t = time.thread_time()
            fn()
            times[name].append(1e3 * (time.thread_time() - t) / per)
    return {k: min(v) for k, v in times.items()}


def once(fn: Callable[[], object]) -> Callable[[], Callable[[], object]]:
    """A variant with nothing to set up."""
    return lambda: fn


STEPS = 8  # decode steps timed per round


def decode_steps(mask: ChannelMask, ctx: int, batch: int, kv_quant: str | None,
                 swap: tuple[object, str, object] | None = None) -> Callable[[], Callable[[], None]]:
    """A variant: set up fresh layers prefilled with ``ctx`` tokens (not timed), then :data:`STEPS` decode steps,
    with ``swap = (module, name, value)`` in place while they run."""
    g = torch.Generator().manual_seed(0)
    k0, v0 = (torch.randn(batch, HKV, ctx, D, generator=g) for _ in range(2))
    news = [tuple(torch.randn(batch, h, 1, D, generator=g) for h in (HQ, HKV, HKV)) for _ in range(STEPS)]

    def setup() -> Callable[[], None]:
        layers = [LeanKLayer(mask.keep[i], mask.sink_size, mask.recent_size, mask.accumu_size, kv_quant=kv_quant)
                  for i in range(mask.num_layers)]
        for layer in layers:
            layer.update(k0, v0, kwargs={})

        def run() -> None:
            real = getattr(swap[0], swap[1]) if swap else None
            if swap:
                setattr(swap[0], swap[1], swap[2])
            try:
                for q, k, v in news:
                    for layer in layers:
                        kw: dict = {}
                        kk, vv = layer.update(k, v, kwargs=kw)
                        leank_attention_forward(_Attn(), q, kk, vv, None, scaling=D**-0.5, **kw)
            finally:
                if swap:
                    setattr(swap[0], swap[1], real)

        return run

    return setup


def decode_case(mask: ChannelMask, contexts: list[int], batches: list[int]) -> None:
    print("decode: ms per step (30 layers)")
    for ctx in contexts:
        for batch in batches:
            r = best_ms({"fused": decode_steps(mask, ctx, batch, None),
                         "general": decode_steps(mask, ctx, batch, None, (torch_decode, "fast_path_applies",
                                                                          lambda *a: False))}, STEPS)
            print(f"  ctx {ctx:>5} batch {batch}: fused {r['fused']:8.1f}  general {r['general']:8.1f}  "
                  f"general/fused {r['general'] / r['fused']:.2f}", flush=True)


def quant_case(mask: ChannelMask, contexts: list[int], batches: list[int]) -> None:
    print("quant (LEANK_CPU_KERNEL=0): ms per step (30 layers)")
    os.environ[quant_cpu.ENV_SWITCH] = "0"
    fast = torch_decode._fast

    def dequantise(query: torch.Tensor, layout, scaling: float) -> torch.Tensor:  # noqa: ANN001
        return fast(query, layout.dequantized(), scaling)

    try:
        for fmt in ("int8", "int4"):
            for ctx in contexts:
                for batch in batches:
                    r = best_ms({"products": decode_steps(mask, ctx, batch, fmt),
                                 "dequantise": decode_steps(mask, ctx, batch, fmt,
                                                            (torch_decode, "_fast_quantised", dequantise))}, STEPS)
                    print(f"  {fmt} ctx {ctx:>5} batch {batch}: PyTorch products {r['products']:8.1f}  "
                          f"dequantise + fused {r['dequantise']:8.1f}  ratio {r['dequantise'] / r['products']:.2f}",
                          flush=True)
    finally:
        os.environ.pop(quant_cpu.ENV_SWITCH)


def prefill_case(mask: ChannelMask, contexts: list[int]) -> None:
    print("prefill: ms for one layer's positional prompt (batch 1)")
    for t in contexts:
        prefill_one(mask, t)


def prefill_one(mask: ChannelMask, t: int, cap: float = 50.0) -> None:
    """The two prefill comparisons (module docstring) for a prompt of ``t`` tokens."""
    keep = mask.keep[min(3, mask.num_layers - 1)]
    sizes = (mask.sink_size, mask.recent_size, mask.accumu_size)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HQ, t, D, generator=g)
    k, v = torch.randn(1, HKV, t, D, generator=g), torch.randn(1, HKV, t, D, generator=g)
    starts = torch.zeros(1, dtype=torch.long)
    out: dict[str, torch.Tensor] = {}
    args = (q, k, v, keep, starts, *sizes, D**-0.5, None, None, 256)

    def keep_out(name: str, fn: Callable[[], torch.Tensor]) -> Callable[[], Callable[[], None]]:
        return once(lambda: out.__setitem__(name, fn()))

    r = best_ms({"sdpa": keep_out("sdpa", lambda: positional_prefill._by_sdpa(*args)),
                 "scores": keep_out("scores", lambda: positional_prefill._by_scores(*args))})
    diff = float((out["sdpa"] - out["scores"]).abs().max())
    print(f"  {t:>5} tokens, no soft-cap: SDPA path {r['sdpa']:8.1f}  scores path {r['scores']:8.1f}  "
          f"ratio {r['scores'] / r['sdpa']:.2f}  (max difference {diff:.1e})", flush=True)
    r = best_ms({
        "scores": keep_out("scores", lambda: positional_prefill.positional_prefill_attention(
            q, k, v, keep, starts, *sizes, D**-0.5, cap)),
        "reference": keep_out("reference", lambda: leank_attention(
            q, k, v, keep.float(), torch.arange(t), sizes[0], sizes[1], D**-0.5, skip_zero_heads=True,
            softcap=cap, accumu_size=sizes[2])),
    })
    diff = float((out["scores"] - out["reference"]).abs().max())
    print(f"  {t:>5} tokens, soft-cap {cap}: scores path {r['scores']:8.1f}  leank_attention "
          f"{r['reference']:8.1f}  ratio {r['reference'] / r['scores']:.2f}  (max difference {diff:.1e})", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mask", default="hub/smollm2-135m-instruct-s3")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--only", default="decode,quant,prefill")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    mask = ChannelMask.from_pretrained(a.mask)
    contexts = [int(x) for x in a.contexts.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    print(f"mask {a.mask}, one torch thread, CPU load average {os.getloadavg()[0]:.1f}; best of {ROUNDS}, CPU time")
    only = a.only.split(",")
    if "decode" in only:
        decode_case(mask, contexts, batches)
    if "quant" in only:
        quant_case(mask, contexts, batches)
    if "prefill" in only:
        prefill_case(mask, contexts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
