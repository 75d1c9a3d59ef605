"""Bytes a prompt token holds in vLLM's pool while its prompt is computed, plain vLLM against LeanK, every mask in hub/.

    .venv-vllm/bin/python benchmarks/vllm_prompt_memory.py [--dtype float32] [--save]

No engine: per mask, the worker plan the plugin builds (:class:`leank_infer.vllm.pool.WorkerPlan`, one worker,
the default rule) and the KV cache specs it gives vLLM (:func:`leank_infer.vllm.pool.kv_specs`), whose
``page_size_bytes`` and ``block_size`` are what vLLM allocates. Under the default rule a prompt token in flight
holds a slot in the packed group and one in every window group (its rest row: the channels its packed row
lacks, which the prompt's later queries read), so its bytes are the sum over the groups of page / block size.
Plain vLLM holds ``2 * kv_heads * head_dim * dtype`` bytes per layer. Also printed: a token once its prompt is
computed and it has left the window (packed row only), and the window groups' count. The last thing printed is a
markdown table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import results  # noqa: E402


def measure(folder: Path, dtype: torch.dtype) -> dict:
    from leank_infer.mask import ChannelMask
    from leank_infer.vllm.pool import WorkerPlan, kv_specs

    mask = ChannelMask.from_pretrained(folder)
    layers = list(range(mask.num_layers))  # the models in hub/ have full attention in every layer
    plan = WorkerPlan.build(mask, layers, dense_prompt=True)
    packed, window = kv_specs(plan, dtype)
    stores = len(plan.window_layers)
    item = torch.empty((), dtype=dtype).element_size()
    plain = 2 * mask.num_kv_heads * mask.head_dim * item * len(layers)
    in_flight = packed.page_size_bytes / packed.block_size + stores * window.page_size_bytes / window.block_size
    return {
        "mask": folder.name, "layers": len(layers), "stores": stores, "plain": plain, "in_flight": in_flight,
        "decoded": packed.page_size_bytes / packed.block_size,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/vllm_prompt_memory.py", description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="KV dtype")
    p.add_argument("--save", action="store_true", help="write the table to docs/results/vllm-prompt-memory.json")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = [measure(f.parent, dtype) for f in sorted(ROOT.glob("hub/*/mask.safetensors"))]
    lines = [
        f"KV bytes per token in vLLM's pool, {args.dtype}, one worker, the default rule (`dense-prompt`).",
        "",
        "| mask | layers | window groups | plain | LeanK, prompt token in flight | vs plain | LeanK, decoded token "
        "| vs plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['mask']}` | {r['layers']} | {r['stores']} | {r['plain']:,} | {r['in_flight']:,.0f} "
            f"| {r['in_flight'] / r['plain']:.2f}x | {r['decoded']:,.0f} | {r['decoded'] / r['plain']:.2f}x |"
        )
    print("\n".join(lines))
    if args.save:
        print(f"saved {results.save('vllm-prompt-memory', chr(10).join(lines))}")


if __name__ == "__main__":
    main()
