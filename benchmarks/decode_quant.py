"""LeanK decode attention alone over an fp32, int8 and int4 middle, side by side: does fewer bytes mean faster?

The CPU time of one step over all 30 layers (``LeanKLayer.update`` then the ``"leank"`` attention), as
benchmarks/decode_layer.py measures it (random K/V of the embedded SmolLM2-135M's shape, the mask's kept
channels, the main thread's CPU time, one torch thread unless ``--threads``), for: the fp32 middle; int8 and
int4 through the CPU kernel (:mod:`leank_infer.decode.quant_cpu`); and int8 and int4 through the PyTorch path
(``LEANK_CPU_KERNEL=0``). The variants alternate, twice, the second round kept; ratios are to the fp32 middle.

    python benchmarks/decode_quant.py [--mask hub/smollm2-135m-instruct-s3] [--contexts 2048,8176] [--batches 1]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from decode_layer import HKV, HQ, D, _Attn

from leank_infer.decode import quant_cpu
from leank_infer.decode.attention import leank_attention_forward
from leank_infer.decode.cache import LeanKLayer
from leank_infer.mask import ChannelMask

VARIANTS = {  # name: (kv_quant, CPU kernel on)
    "fp32": (None, True),
    "int8": ("int8", True),
    "int4": ("int4", True),
    "int8 torch": ("int8", False),
    "int4 torch": ("int4", False),
}


def run(mask: ChannelMask, ctx: int, batch: int, steps: int) -> dict[str, float]:
    """ms of CPU time per decode step (all layers) of each variant."""
    g = torch.Generator().manual_seed(0)
    k0, v0 = (torch.randn(batch, HKV, ctx, D, generator=g) for _ in range(2))
    news = [tuple(torch.randn(batch, h, 1, D, generator=g) for h in (HQ, HKV, HKV)) for _ in range(steps)]
    module = _Attn()
    layers = {}
    for name, (kv_quant, _) in VARIANTS.items():
        layers[name] = [
            LeanKLayer(mask.keep[i], mask.sink_size, mask.recent_size, mask.accumu_size, kv_quant=kv_quant)
            for i in range(mask.num_layers)
        ]
        for layer in layers[name]:
            layer.update(k0, v0, kwargs={})
    out: dict[str, float] = {}
    for name in list(VARIANTS) * 2:
        os.environ[quant_cpu.ENV_SWITCH] = "1" if VARIANTS[name][1] else "0"
        t = time.thread_time()
        for q, k, v in news:
            for layer in layers[name]:
                kw: dict = {}
                kk, vv = layer.update(k, v, kwargs=kw)
                leank_attention_forward(module, q, kk, vv, None, scaling=D**-0.5, **kw)
        out[name] = (time.thread_time() - t) / steps * 1000
    os.environ.pop(quant_cpu.ENV_SWITCH)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mask", default="hub/smollm2-135m-instruct-s3")
    p.add_argument("--contexts", default="2048,8176")
    p.add_argument("--batches", default="1")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if not quant_cpu.available():
        raise SystemExit("the CPU kv_quant kernel is not available (no C++ compiler?): nothing to compare")
    mask = ChannelMask.from_pretrained(a.mask)
    print(f"mask {a.mask}, {mask.num_layers} layers, {a.threads} torch thread(s), "
          f"CPU load average {os.getloadavg()[0]:.1f}; ms of CPU time per step (attention + cache update, all layers)")
    names = list(VARIANTS)
    print(f"{'context':>7} {'batch':>5} | " + " ".join(f"{n:>10}" for n in names) + " | ratio to fp32")
    for ctx in (int(x) for x in a.contexts.split(",")):
        for batch in (int(x) for x in a.batches.split(",")):
            r = run(mask, ctx, batch, a.steps)
            ratios = " ".join(f"{n} {r[n] / r['fp32']:.2f}" for n in names[1:])
            print(f"{ctx:>7} {batch:>5} | " + " ".join(f"{r[n]:>10.2f}" for n in names) + f" | {ratios}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
