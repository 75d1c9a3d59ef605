"""How many sequences fit on one GPU, dense vs LeanK: KV GiB per sequence and the largest batch.

Why: the first question a user serving an 8B model asks of a KV-cache method is "how much larger a
batch (or longer a context) does it buy on my GPU?". Assumptions (printed with every table):

- everything but the base model's weights holds KV cache: activations, the CUDA context, allocator
  slack and the framework's own reserve are not counted, so the batches are upper bounds for both;
- a LeanK sequence at its largest during decode: ``sink + recent + accumu`` tokens with every
  channel, the rest as pruned middle tokens (K kept channels + V of heads that keep any);
- dense = every token with every channel (transformers' DynamicCache, vLLM's paged cache alike).

    leank bench hub/llama-3.1-8b-instruct --capacity 80
"""

from __future__ import annotations

from typing import Any

import torch

from .channel_mask import ChannelMask
from .kv_bytes import value_bytes

GiB = 1024**3
CONTEXTS = (4096, 32768, 131072)
ASSUMPTION = (
    "weights = parameters x bytes of the dtype; all the rest holds KV (no activations, CUDA context or allocator "
    "reserve counted: upper bounds); LeanK at its largest during decode (sink + recent + accumulation tokens full)"
)


def base_parameters(mask: ChannelMask) -> int | None:
    """Parameters of the mask's base model, when its folder records them (imported reference masks do)."""
    n = (mask.extra or {}).get("base_model_parameters")
    return int(n) if isinstance(n, int) and n > 0 else None


def sequence_kv_bytes(mask: ChannelMask, tokens: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """K+V bytes of one sequence of ``tokens``: dense, and LeanK at its largest during decode."""
    per = mask.kv_bytes_per_token(dtype)
    full = min(tokens, mask.sink_size + mask.recent_size + mask.accumu_size)
    return {"dense": tokens * per["dense"], "leank": full * per["dense"] + (tokens - full) * per["leank_middle"]}


def capacity_rows(
    mask: ChannelMask,
    gpu_gib: float,
    weights_bytes: float,
    dtype: torch.dtype = torch.bfloat16,
    contexts: tuple[int, ...] = CONTEXTS,
) -> list[dict[str, Any]]:
    """Per context: KV GiB per sequence and the largest batch in ``gpu_gib`` after the weights, dense vs LeanK."""
    if gpu_gib <= 0:
        raise ValueError(f"GPU memory must be positive, got {gpu_gib} GiB")
    free = gpu_gib * GiB - weights_bytes
    rows = []
    for tokens in contexts:
        kv = sequence_kv_bytes(mask, tokens, dtype)
        dense_batch = max(0, int(free // kv["dense"]))
        leank_batch = max(0, int(free // kv["leank"]))
        rows.append({
            "context": tokens,
            "dense_gib": kv["dense"] / GiB,
            "leank_gib": kv["leank"] / GiB,
            "dense_batch": dense_batch,
            "leank_batch": leank_batch,
        })  # fmt: skip
    return rows


def capacity_table(
    mask: ChannelMask,
    gpu_gib: float,
    weights_bytes: float,
    dtype: torch.dtype = torch.bfloat16,
    contexts: tuple[int, ...] = CONTEXTS,
) -> str:
    """The markdown table of :func:`capacity_rows`."""
    lines = [
        "| context | dense KV GiB / seq | LeanK KV GiB / seq | dense max batch | LeanK max batch | batch gain |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in capacity_rows(mask, gpu_gib, weights_bytes, dtype, contexts):
        gain = f"{r['leank_batch'] / r['dense_batch']:.2f}x" if r["dense_batch"] else "-"
        lines.append(f"| {r['context']:,} | {r['dense_gib']:.3f} | {r['leank_gib']:.3f} | {r['dense_batch']} | "
                     f"{r['leank_batch']} | {gain} |")  # fmt: skip
    return "\n".join(lines)


def weights_bytes_of(mask: ChannelMask, weights_gib: float | None, dtype: torch.dtype) -> float:
    """Bytes of the base model's weights: ``weights_gib`` if given, else the recorded parameters x dtype size."""
    if weights_gib is not None:
        if weights_gib < 0:
            raise ValueError(f"--weights-gib must be >= 0, got {weights_gib}")
        return weights_gib * GiB
    n = base_parameters(mask)
    if n is None:
        raise ValueError(
            "the mask does not record its base model's parameter count: pass --weights-gib (GiB of weights)"
        )
    return n * value_bytes(dtype)


def capacity_main(
    mask_path: str, gpu_gibs: list[float], weights_gib: float | None, dtype: torch.dtype, command: str
) -> int:
    """Print one capacity table per GPU memory size (``leank bench MASK --capacity GiB[,GiB]``)."""
    mask = ChannelMask.from_pretrained(mask_path)
    weights = weights_bytes_of(mask, weights_gib, dtype)
    name = str(dtype).replace("torch.", "")
    print(f"command: {command}")
    print(f"mask: {mask_path} (base model {mask.base_model}), {name} K/V; weights {weights / GiB:.2f} GiB")
    print(f"assumption: {ASSUMPTION}")
    for gib in gpu_gibs:
        print(f"\nGPU memory {gib:g} GiB:\n")
        print(capacity_table(mask, gib, weights, dtype))
    return 0
