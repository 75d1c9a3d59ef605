"""Decode attention alone, dense vs LeanK, side by side: the CPU time of one step over all 30 layers.

Dense is what transformers does per layer and step (``DynamicLayer.update``: a ``torch.cat`` of the
whole cache, then SDPA); LeanK is ``LeanKLayer.update`` then the ``"leank"`` attention (PyTorch
path). Random K/V of the embedded SmolLM2-135M's shape (9 query / 3 KV heads, head_dim 64) with
the committed mask's kept channels; the rest of the model (projections, MLP) is the same for both
and left out. Times are the main thread's CPU time (``time.thread_time``, one torch thread), so a
CPU shared with other jobs disturbs them far less than wall-clock time; the two alternate, twice,
the second round kept.

    python benchmarks/decode_layer.py [--contexts 512,1024,...] [--batches 1,4,8] [--steps 24]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from leank_infer.decode.attention import leank_attention_forward
from leank_infer.decode.cache import LeanKLayer
from leank_infer.mask import ChannelMask

HQ, HKV, D = 9, 3, 64


class _Attn(nn.Module):
    is_causal = True
    num_key_value_groups = HQ // HKV


def run(mask: ChannelMask, ctx: int, batch: int, steps: int) -> dict[str, float]:
    """ms of CPU time per decode step (all layers), dense and LeanK."""
    g = torch.Generator().manual_seed(0)
    k0, v0 = (torch.randn(batch, HKV, ctx, D, generator=g) for _ in range(2))
    news = [tuple(torch.randn(batch, h, 1, D, generator=g) for h in (HQ, HKV, HKV)) for _ in range(steps)]
    module = _Attn()
    layers = range(mask.num_layers)
    dense = [DynamicLayer() for _ in layers]
    leank = [LeanKLayer(mask.keep[i], mask.sink_size, mask.recent_size, mask.accumu_size) for i in layers]
    for d_layer, l_layer in zip(dense, leank, strict=True):
        d_layer.update(k0, v0)
        l_layer.update(k0, v0, kwargs={})
    out: dict[str, float] = {}
    for name in ("dense", "leank") * 2:
        t = time.thread_time()
        for q, k, v in news:
            if name == "dense":
                for layer in dense:
                    kk, vv = layer.update(k, v)
                    sdpa_attention_forward(module, q, kk, vv, None, scaling=D**-0.5)
            else:
                for layer in leank:
                    kw: dict = {}
                    kk, vv = layer.update(k, v, kwargs=kw)
                    leank_attention_forward(module, q, kk, vv, None, scaling=D**-0.5, **kw)
        out[name] = (time.thread_time() - t) / steps * 1000
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mask", default="hub/smollm2-135m-instruct")
    p.add_argument("--contexts", default="512,1024,2048,4096,8192")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--steps", type=int, default=24)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    mask = ChannelMask.from_pretrained(a.mask)
    print(f"mask {a.mask}, {mask.num_layers} layers, 1 torch thread, CPU load average {os.getloadavg()[0]:.1f}")
    print(f"{'context':>7} {'batch':>5} | {'dense ms':>8} {'LeanK ms':>8} {'speedup':>7}")
    for ctx in (int(x) for x in a.contexts.split(",")):
        for batch in (int(x) for x in a.batches.split(",")):
            r = run(mask, ctx, batch, a.steps)
            print(f"{ctx:>7} {batch:>5} | {r['dense']:>8.2f} {r['leank']:>8.2f} {r['dense'] / r['leank']:>6.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
