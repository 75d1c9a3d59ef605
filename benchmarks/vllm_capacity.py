"""KV tokens vLLM holds in the same memory, plain vs LeanK, for every mask of the embedded model, fp32 and fp8.

    .venv-vllm/bin/python benchmarks/vllm_capacity.py [--masks hub/smollm2-135m-instruct*] [--kv-gib 1]
        [--contexts 4096 8192] [--dtypes auto fp8] [--json out.json]

Each engine starts in a fresh process on the embedded SmolLM2-135M-Instruct (the de-quantised copy in
``~/.cache/leank``, offline; fp32 weights) with ``VLLM_CPU_KVCACHE_SPACE=--kv-gib`` and vLLM's defaults
(prefix caching and chunked prefill on). Per KV dtype (``auto`` = fp32, ``fp8``) and context C
(``max_model_len = C``; eager mode, which does not change the pool) it prints what vLLM reports at start-up: "KV cache size: N tokens", which is
vLLM's maximum concurrency for C-token requests times C. With a mask that count includes everything
LeanK stores (packed rows for every token, and per request the full-channel sink and window pages at
their peak), so the ratio is the gain a user sees in vLLM's own report. The last thing printed is a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import results  # noqa: E402


def model_dir() -> str:
    found = sorted(Path.home().joinpath(".cache", "leank").glob("SmolLM2-135M-Instruct*/model.safetensors"))
    if not found:
        sys.exit("no de-quantised embedded model in ~/.cache/leank: run `make test-vllm` (or load_base_model) first")
    return str(found[-1].parent)


def embedded_masks() -> list[str]:
    """The masks in hub/ learned on the embedded model."""
    return sorted(
        str(p.parent.relative_to(ROOT))
        for p in ROOT.glob("hub/*/config.json")
        if "SmolLM2-135M" in json.loads(p.read_text()).get("base_model", "")
    )


def child(args: argparse.Namespace) -> None:
    """One engine: what vLLM reports; prints one JSON line."""
    from vllm import LLM

    extra = {"additional_config": {"leank_mask": args.mask}} if args.mask else {}
    # enforce_eager: the pool does not depend on compilation (on CPU its size is VLLM_CPU_KVCACHE_SPACE), and
    # skipping it makes each engine start in seconds
    llm = LLM(model=model_dir(), dtype="float32", max_model_len=args.context, kv_cache_dtype=args.dtype,
              enforce_eager=True, **extra)  # fmt: skip
    cache = llm.llm_engine.vllm_config.cache_config
    print("RESULT " + json.dumps({
        "mask": args.mask or "plain", "context": args.context, "kv_dtype": args.dtype,
        "kv_cache_tokens": cache.kv_cache_size_tokens, "max_concurrency": cache.kv_cache_max_concurrency,
        "num_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
    }), flush=True)  # fmt: skip


def engine(args: argparse.Namespace, env: dict, mask: str, context: int, dtype: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--context", str(context), "--mask", mask, "--dtype", dtype]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    if run.returncode or not line:
        sys.exit(f"engine failed ({mask or 'plain'}, {context}, {dtype}):\n{run.stderr[-4000:]}")
    return json.loads(line[-1][7:])


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/vllm_capacity.py", description=__doc__.splitlines()[0])
    p.add_argument("--masks", nargs="+", default=None, help="mask folders (default: every embedded-model mask in hub/)")
    p.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--dtypes", nargs="+", default=["auto", "fp8"], help="kv_cache_dtype values")
    p.add_argument("--json", type=Path)
    p.add_argument("--save", action="store_true", help="write the table to docs/results/vllm-capacity.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)
    p.add_argument("--mask", default="", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib), "HF_HUB_OFFLINE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(ROOT)}  # fmt: skip
    masks = args.masks or embedded_masks()
    rows = []
    for dtype in args.dtypes:
        for context in args.contexts:
            plain = engine(args, env, "", context, dtype)
            rows.append(plain)
            for mask in masks:
                row = engine(args, env, mask, context, dtype)
                row["ratio"] = row["kv_cache_tokens"] / plain["kv_cache_tokens"]
                rows.append(row)
                print(f"{dtype} {context} {mask}: {row['kv_cache_tokens']:,} tokens ({row['ratio']:.2f}x)", flush=True)
    lines = [
        f"Embedded SmolLM2-135M-Instruct, fp32 weights, VLLM_CPU_KVCACHE_SPACE={args.kv_gib} GiB, vLLM's defaults.",
        "",
        "| KV dtype | max_model_len | engine | KV cache size (tokens) | vs plain |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "1.00x"
        dtype = "fp32" if r["kv_dtype"] == "auto" else r["kv_dtype"]
        lines.append(f"| {dtype} | {r['context']} | {r['mask']} | {r['kv_cache_tokens']:,} | {ratio} |")
    print("\n" + "\n".join(lines))
    if args.save:
        print(f"saved {results.save('vllm-capacity', chr(10).join(lines))}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
