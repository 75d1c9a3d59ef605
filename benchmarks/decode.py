"""Decode step latency, tokens/s and KV bytes: dense (HF generate, DynamicCache, SDPA) vs LeanK.

Runs on the embedded SmolLM2-135M-Instruct in one process. Each configuration runs plain
``model.generate`` twice on the same random prompt, once with a DynamicCache under SDPA and once
with a LeanK cache; a stopping criterion timestamps every step, so the decode step latency is
the median gap between consecutive steps (prefill excluded). Example (quick):

    python benchmarks/decode.py --contexts 2048 --batches 1 --new-tokens 16
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from leank_infer import ChannelMask, LeanKModel, load_base_model
from leank_infer.cache import dynamic_cache_bytes

DEFAULT_MASK = Path(__file__).resolve().parents[1] / "hub" / "smollm2-135m-instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _StepClock(StoppingCriteria):
    """Records a timestamp after every generation step; never stops anything."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _mask(path: str | None, model_config) -> tuple[ChannelMask, str]:
    folder = Path(path) if path else DEFAULT_MASK
    if (folder / "config.json").is_file():
        return ChannelMask.from_pretrained(folder), f"trained mask {folder}"
    if path:
        raise SystemExit(f"no mask at {path}")
    from leank_infer.mask import model_shape

    scores = torch.rand(*model_shape(model_config), generator=torch.Generator().manual_seed(0))
    mask = ChannelMask.from_scores(scores, 0.7, 16, sink_size=16, recent_size=64, accumu_size=16)
    return (
        mask,
        f"RANDOM mask (no {DEFAULT_MASK.name} in hub/): ratio 0.7, align 16, sink 16, recent 64, accumu 16",
    )


def _run(model, ids: torch.Tensor, cache, new_tokens: int) -> dict[str, float]:
    clock = _StepClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([clock]),
            pad_token_id=0,
        )
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
    return {
        "prefill_s": clock.times[0] - t0,
        "step_ms": 1000 * statistics.median(gaps),
        "tok_s": ids.shape[0] * len(gaps) / sum(gaps),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--mask", default=None, help=f"mask folder (default: {DEFAULT_MASK} if present, else random)"
    )
    p.add_argument("--contexts", default="2048,4096,8192", help="comma-separated prompt lengths")
    p.add_argument("--batches", default="1,4", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per run (>= 3)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per configuration, dense and LeanK alternating; the best is kept",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    new_tokens = max(3, args.new_tokens)
    dtype = DTYPES[args.dtype]

    print("command: python benchmarks/decode.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    model, _ = load_base_model("embedded", dtype=dtype)
    mask, where = _mask(args.mask, model.config)
    stats = mask.stats(dtype=dtype)
    print(
        f"model: embedded SmolLM2-135M-Instruct, {args.dtype}, torch threads {torch.get_num_threads()}, "
        f"CPU load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(f"mask: {where}; K kept {stats['k_kept_fraction']:.1%}, V kept {stats['v_kept_fraction']:.1%}")
    lk = LeanKModel(model, mask)
    header = (
        f"{'context':>7} {'batch':>5} | {'dense ms/step':>13} {'LeanK ms/step':>13} {'speedup':>7} | "
        f"{'dense tok/s':>11} {'LeanK tok/s':>11} | {'dense KV MiB':>12} {'LeanK KV MiB':>12} {'KV ratio':>8}"
    )
    print(header)
    print("-" * len(header))
    for ctx in contexts:
        for batch in batches:
            ids = torch.randint(
                100, model.config.vocab_size, (batch, ctx), generator=torch.Generator().manual_seed(ctx)
            )
            dense = leank = None
            for _ in range(max(1, args.repeats)):  # alternate, keep the best of each (shared CPUs are noisy)
                model.set_attn_implementation("sdpa")
                dense_cache = DynamicCache(config=model.config)
                run = _run(model, ids, dense_cache, new_tokens)
                dense = run if dense is None or run["step_ms"] < dense["step_ms"] else dense
                dense_bytes = dynamic_cache_bytes(dense_cache)
                del dense_cache
                model.set_attn_implementation("leank")
                leank_cache = lk.new_cache()
                run = _run(model, ids, leank_cache, new_tokens)
                leank = run if leank is None or run["step_ms"] < leank["step_ms"] else leank
                leank_bytes = lk.kv_cache_bytes(leank_cache)
                del leank_cache
            print(
                f"{ctx:>7} {batch:>5} | {dense['step_ms']:>13.1f} {leank['step_ms']:>13.1f} "
                f"{dense['step_ms'] / leank['step_ms']:>6.2f}x | {dense['tok_s']:>11.1f} {leank['tok_s']:>11.1f} | "
                f"{dense_bytes / 2**20:>12.1f} {leank_bytes / 2**20:>12.1f} {leank_bytes / dense_bytes:>8.3f}",
                flush=True,
            )
    print(
        "speedup = dense ms/step / LeanK ms/step (median decode step, prefill excluded); KV ratio = LeanK/dense bytes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
