"""vLLM's own KV capacity, plain vs LeanK, in the same KV memory (issue 17's memory goal), and decode speed.

    .venv-vllm/bin/python benchmarks/vllm_capacity.py [--mask hub/smollm2-135m-instruct] [--kv-gib 1]
        [--contexts 4096 8192] [--requests 2] [--new-tokens 16] [--json out.json]

Each engine runs in a fresh process (in-process engine core) on the embedded SmolLM2 (the
de-quantised copy in ~/.cache/leank, offline), fp32, ``VLLM_CPU_KVCACHE_SPACE=--kv-gib``. Per
engine and context C (``max_model_len = C``) it prints what vLLM reports at start-up: "KV cache
size: N tokens" and the maximum concurrency for C-token requests (N / C, the most sequences of
that length the pool holds at once); with ``--requests R > 0`` it also runs R concurrent requests
of C - new_tokens prompt tokens and prints the decode tokens/s (new tokens of all requests over
the time after the prefill step). Use ``--requests 0`` for capacity only (fast).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def model_dir() -> str:
    found = sorted(Path.home().joinpath(".cache", "leank").glob("SmolLM2-135M-Instruct*/model.safetensors"))
    if not found:
        sys.exit(
            "no de-quantised embedded model in ~/.cache/leank: run `make test-vllm` (or load_base_model) first"
        )
    return str(found[-1].parent)


def child(args: argparse.Namespace) -> None:
    """One engine: capacity, then (optionally) a timed decode; prints one JSON line."""
    from vllm import LLM, SamplingParams, TokensPrompt

    extra = {"additional_config": {"leank_mask": args.mask}} if args.mask else {}
    llm = LLM(
        model=model_dir(),
        dtype="float32",
        max_model_len=args.context,
        max_num_batched_tokens=max(args.context, 2048) * max(1, args.requests),
        max_num_seqs=max(1, args.requests),
        enforce_eager=True,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        **extra,
    )
    cache = llm.llm_engine.vllm_config.cache_config
    out = {
        "engine": "leank" if args.mask else "plain",
        "context": args.context,
        "kv_cache_tokens": cache.kv_cache_size_tokens,
        "max_concurrency": cache.kv_cache_max_concurrency,
    }
    if args.requests:
        prompt_len = args.context - args.new_tokens
        prompts = [
            TokensPrompt(prompt_token_ids=[(17 * i + 31 * j) % 20000 + 100 for j in range(prompt_len)])
            for i in range(args.requests)
        ]
        prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        full = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, prefill, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate(prompts, full, use_tqdm=False)
        t2 = time.perf_counter()
        # decode time: the full run minus its prefill (measured alone just before, same batch)
        decode_s = (t2 - t1) - (t1 - t0)
        # on a busy machine the prefill's own variance can exceed the decode time: then there is no figure
        if decode_s > 0.1 * (t1 - t0):
            out["decode_tokens_per_s"] = args.requests * (args.new_tokens - 1) / decode_s
        out["prefill_s"] = t1 - t0
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python benchmarks/vllm_capacity.py", description=__doc__.splitlines()[0]
    )
    p.add_argument("--mask", default=str(ROOT / "hub" / "smollm2-135m-instruct"))
    p.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--requests", type=int, default=0)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--json", type=Path)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib),
        "HF_HUB_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    rows = []
    for context in args.contexts:
        for mask in ("", args.mask):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                "--context",
                str(context),
                "--mask",
                mask,
                "--requests",
                str(args.requests),
                "--new-tokens",
                str(args.new_tokens),
            ]
            run = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
            if run.returncode or not line:
                sys.exit(f"engine failed ({'leank' if mask else 'plain'}, {context}):\n{run.stderr[-4000:]}")
            rows.append(json.loads(line[-1][7:]))
    print(f"embedded SmolLM2-135M-Instruct, fp32, VLLM_CPU_KVCACHE_SPACE={args.kv_gib} GiB, mask {args.mask}")
    print("| context | engine | KV cache size (tokens) | max concurrent seqs | decode tok/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        speed = f"{r['decode_tokens_per_s']:.1f}" if "decode_tokens_per_s" in r else "-"
        print(
            f"| {r['context']} | {r['engine']} | {r['kv_cache_tokens']:,} | {r['max_concurrency']:.2f} | {speed} |"
        )
    import torch

    from leank_infer import ChannelMask

    mask = ChannelMask.from_pretrained(args.mask)
    per = mask.kv_bytes_per_token(torch.float32)
    side = (mask.sink_size + mask.recent_size + mask.accumu_size + 1) * per["dense"]
    for context in args.contexts:
        plain, leank = (r for r in rows if r["context"] == context)
        gain = leank["kv_cache_tokens"] / plain["kv_cache_tokens"]
        # with the full-channel side store (sink + recent + accumu + 1 tokens, outside vLLM's pool) counted too
        dense_req, leank_req = context * per["dense"], context * per["leank_middle"] + side
        print(
            f"context {context}: LeanK holds {gain:.2f}x the tokens; per request {leank_req / 1e6:.1f} MB "
            f"(pages + {side / 1e6:.1f} MB side store) vs {dense_req / 1e6:.1f} MB: "
            f"{dense_req / leank_req:.2f}x the requests in the same memory"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
