"""Bytes a prompt token holds in vLLM's pool while its prompt is computed, plain vLLM against LeanK, every mask in hub/.

    .venv-vllm/bin/python benchmarks/vllm_prompt_memory.py [--dtype float32] [--aligns 16 128 256] [--save]

No engine: per mask, the worker plan the plugin builds (:class:`leank_infer.vllm.pool.WorkerPlan`, one worker,
the default rule) and the KV cache specs it gives vLLM (:func:`leank_infer.vllm.kv_specs.kv_specs`), whose
``page_size_bytes`` and ``block_size`` are what vLLM allocates. Under the default rule a prompt token in flight
holds a slot in the packed group and one in every window group (its rest row: the channels its packed row
lacks, which the prompt's later queries read), so its bytes are the sum over the groups of page / block size.
Plain vLLM holds ``2 * kv_heads * head_dim * dtype`` bytes per layer. Also printed: a token once its prompt is
computed and it has left the window (packed row only), the window groups' count and block size, the token count
vLLM aligns prefix-cache hits to (the least common multiple of the groups' block sizes), and what hashing an 8k
prompt's blocks for the prefix cache takes (vLLM's sha256, at the greatest common divisor of the block sizes;
the fastest of 3; plain vLLM on CPU hashes at its default block of 128 tokens). One row per mask and value of
``--aligns``, the ``leank_prefix_align`` setting (by default vLLM's own block size: 128 on CPU, 16 with most CUDA
backends; the packed and window pages' block sizes, :func:`leank_infer.vllm.pool.fit_blocks`, follow from it, as
the plugin picks them where ``--block-size`` is not given). The last thing printed is a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import results  # noqa: E402


def measure(folder: Path, dtype: torch.dtype, align: int) -> dict:
    from leank_infer.mask import ChannelMask
    from leank_infer.vllm.kv_specs import kv_specs
    from leank_infer.vllm.pool import WorkerPlan

    mask = ChannelMask.from_pretrained(folder)
    layers = list(range(mask.num_layers))  # the models in hub/ have full attention in every layer
    plan = WorkerPlan.build(mask, layers, dense_prompt=True, prefix_align=align, fit_packed=True)
    packed, window = kv_specs(plan, dtype)
    stores = len(plan.window_layers)
    item = torch.empty((), dtype=dtype).element_size()
    plain = 2 * mask.num_kv_heads * mask.head_dim * item * len(layers)
    in_flight = packed.page_size_bytes / packed.block_size + stores * window.page_size_bytes / window.block_size
    return {
        "mask": folder.name, "prefix_align": align, "layers": len(layers), "stores": stores, "plain": plain, "in_flight": in_flight,
        "decoded": packed.page_size_bytes / packed.block_size, "block": packed.block_size,
        "window_block": window.block_size,
        "align": math.lcm(packed.block_size, window.block_size),
        "hash_ms": hash_ms(math.gcd(packed.block_size, window.block_size)),
    }  # fmt: skip


@functools.cache
def hash_ms(unit: int, tokens: int = 8192) -> float:
    """Milliseconds vLLM's prefix cache takes to hash a ``tokens``-token prompt in blocks of ``unit`` tokens (its
    default sha256, chained over the blocks as for every request it gets), the fastest of 3."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    ids = list(range(tokens))
    best = float("inf")
    for _ in range(3):
        start, parent = time.perf_counter(), None
        for i in range(0, tokens - unit + 1, unit):
            parent = hash_block_tokens(fn, parent, ids[i : i + unit])
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/vllm_prompt_memory.py", description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="KV dtype")
    p.add_argument("--aligns", type=int, nargs="+", default=[16, 128, 256], help="leank_prefix_align values (tokens)")
    p.add_argument("--save", action="store_true", help="write the table to docs/results/vllm-prompt-memory.json")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = [measure(f.parent, dtype, a) for f in sorted(ROOT.glob("hub/*/mask.safetensors")) for a in args.aligns]
    lines = [
        f"KV bytes per token in vLLM's pool against plain vLLM's, {args.dtype}, one worker, the default rule "
        "(`dense-prompt`), block sizes as the plugin picks them without `--block-size` (`leank_prefix_align` "
        "defaults to vLLM's block size: 128 on CPU, 16 with most CUDA backends). Hashing an 8k prompt for the prefix "
        f"cache: plain vLLM (128-token blocks, its CPU default) {hash_ms(128):.1f} ms.",
        "",
        "| mask | `leank_prefix_align` | packed block | window stores x block | plain, B/token | prompt token in flight "
        "| decoded token | hits align to | hashing 8k tokens, ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['mask']}` | {r['prefix_align']} | {r['block']} | {r['stores']} x {r['window_block']} | {r['plain']:,} "
            f"| {r['in_flight'] / r['plain']:.2f}x | {r['decoded'] / r['plain']:.2f}x | {r['align']} "
            f"| {r['hash_ms']:.1f} |"
        )
    print("\n".join(lines))
    if args.save:
        print(f"saved {results.save('vllm-prompt-memory', chr(10).join(lines))}")


if __name__ == "__main__":
    main()
