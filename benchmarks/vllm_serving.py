"""Two serving workloads, plain vLLM vs vLLM + LeanK, each engine fresh, vLLM's defaults on.

    .venv-vllm/bin/python benchmarks/vllm_serving.py [--mask hub/smollm2-135m-instruct-s3] [--kv-gib 1]
        [--workloads prefix ttft] [--rules dense-prompt positional] [--threads 2] [--repeats 1] [--json out.json]

- ``prefix``: 32 requests sharing one 3,000-token document, each with its own question (what a RAG or
  chat server with one system prompt sees), 16 new tokens each, all submitted at once. Prints the
  wall time, output tokens/s and the prefix-cache hit rate (cached prompt tokens over prompt tokens,
  from each request's ``num_cached_tokens``).
- ``ttft``: a mixed load under chunked prefill: 8 requests decode (1,000-token prompts, 64 new tokens);
  once they are decoding, 4 new requests of 3,000 tokens arrive. Prints each arrival's time to first
  token, the decoders' output tokens/s while the arrivals prefill and the distribution of those steps'
  times (median, 90th percentile, longest: a step that runs a long prompt's chunk stalls the decoders in
  it), driving the engine one ``step()`` at a time (wall clock).

One LeanK engine per rule of ``--rules`` (``additional_config`` ``leank_rule``; default the plugin's default,
``dense-prompt``), after the plain one. The embedded SmolLM2-135M-Instruct (the de-quantised copy in ``~/.cache/leank``, offline), fp32, with
``VLLM_CPU_KVCACHE_SPACE=--kv-gib`` and ``OMP_NUM_THREADS=--threads`` for both engines. ``--repeats N``
starts every engine N times, the engines alternating, and reports each one's best try (the shortest wall
time, the shortest median time to first token) with every try beside it: the same engine started twice on
a small shared machine runs up to ~1.4x apart. The last thing printed is a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import results  # noqa: E402
from vllm_capacity import model_dir  # noqa: E402

from leank_infer.vllm.settings import SERVED_RULES  # noqa: E402


def tokens(n: int, seed: int) -> list[int]:
    return [(7919 * seed + 104729 * j) % 20000 + 100 for j in range(n)]


def prefix(llm) -> dict:  # noqa: ANN001
    from vllm import SamplingParams, TokensPrompt

    doc = tokens(3000, 1)
    prompts = [TokensPrompt(prompt_token_ids=doc + tokens(24, 100 + i)) for i in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    total = sum(len(o.prompt_token_ids) for o in outs)
    return {"wall_s": wall, "output_tok_s": 32 * 16 / wall, "hit_rate": cached / total}


def ttft(llm) -> dict:  # noqa: ANN001
    from vllm import SamplingParams, TokensPrompt

    engine = llm.llm_engine
    decode = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"d{i}", TokensPrompt(prompt_token_ids=tokens(1000, 10 + i)), decode)
    produced: dict[str, int] = {}
    while len([r for r, n in produced.items() if r.startswith("d") and n >= 2]) < 8:  # all decoding
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    arrive = time.perf_counter()
    first: dict[str, float] = {}
    for i in range(4):
        engine.add_request(f"a{i}", TokensPrompt(prompt_token_ids=tokens(3000, 50 + i)), SamplingParams(max_tokens=1))
    steps, decoded = [], 0
    while len(first) < 4:
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        for out in outs:
            if out.request_id.startswith("a") and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - arrive
            elif out.request_id.startswith("d"):
                n = len(out.outputs[0].token_ids)
                decoded += n - produced.get(out.request_id, n)
                produced[out.request_id] = n
    while engine.has_unfinished_requests():
        engine.step()
    during = sum(steps)
    ms = sorted(1e3 * x for x in steps)
    return {
        "ttft_s": sorted(first.values()),
        "ttft_median_s": statistics.median(first.values()),
        "decode_tok_s_during": decoded / during,
        "step_ms": [statistics.median(ms), ms[min(len(ms) - 1, int(0.9 * len(ms)))], ms[-1]],
    }


def child(args: argparse.Namespace) -> None:
    from vllm import LLM

    extra = {"additional_config": {"leank_mask": args.mask, "leank_rule": args.rule}} if args.mask else {}
    llm = LLM(model=model_dir(), dtype="float32", max_model_len=4096, **extra)
    out = {"engine": f"leank, {args.rule}" if args.mask else "plain", "workload": args.workload}
    out.update(prefix(llm) if args.workload == "prefix" else ttft(llm))
    print("RESULT " + json.dumps(out), flush=True)


def best_of(tries: list[dict]) -> list[dict]:
    """One row per (workload, engine), in first-seen order: its try with the shortest wall time (prefix) or median
    time to first token (ttft), with every try's figure in ``tries``."""
    return results.best_of(
        tries, lambda r: (r["workload"], r["engine"]),
        lambda r: r["wall_s"] if r["workload"] == "prefix" else r["ttft_median_s"], higher=False,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/vllm_serving.py", description=__doc__.splitlines()[0])
    p.add_argument("--mask", default=str(ROOT / "hub" / "smollm2-135m-instruct-s3"))
    p.add_argument("--kv-gib", type=int, default=1)
    p.add_argument("--workloads", nargs="+", default=["prefix", "ttft"], choices=["prefix", "ttft"])
    p.add_argument("--rules", nargs="+", default=[SERVED_RULES[0]], choices=SERVED_RULES,
                   help="one LeanK engine per rule (additional_config leank_rule)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="fresh engines per side, alternating; each row its best")
    p.add_argument("--json", type=Path)
    p.add_argument("--save", action="store_true", help="write the table to docs/results/vllm-serving.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--rule", default=SERVED_RULES[0], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib), "HF_HUB_OFFLINE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}  # fmt: skip
    tries = []
    for _ in range(args.repeats):
        for workload in args.workloads:
            for mask, rule in [("", SERVED_RULES[0]), *((args.mask, r) for r in args.rules)]:  # plain: rule unused
                cmd = [sys.executable, __file__, "--child", "--workload", workload, "--mask", mask, "--rule", rule]
                run = subprocess.run(cmd, capture_output=True, text=True, env=env)
                line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
                if run.returncode or not line:
                    sys.exit(f"engine failed ({mask or 'plain'}, {workload}):\n{run.stderr[-4000:]}")
                tries.append(json.loads(line[-1][7:]))
                print(tries[-1], flush=True)
    rows = best_of(tries)
    mask = Path(args.mask).resolve()
    lines = [
        f"Embedded SmolLM2-135M-Instruct, fp32, {args.kv_gib} GiB KV, {args.threads} threads, mask "
        f"{mask.relative_to(ROOT) if mask.is_relative_to(ROOT) else mask}, vLLM's defaults"
        + (f"; each row the best of {args.repeats} fresh engines, the engines alternating." if args.repeats > 1 else "."),
        "",
        "| workload | engine | result |",
        "|---|---|---|",
    ]
    for r in rows:
        if r["workload"] == "prefix":
            text = f"{r['wall_s']:.1f} s, {r['output_tok_s']:.1f} output tok/s, prefix hit rate {r['hit_rate']:.2f}"
        else:
            text = (f"TTFT median {r['ttft_median_s']:.2f} s ({', '.join(f'{t:.2f}' for t in r['ttft_s'])}), "
                    f"the 8 decoders {r['decode_tok_s_during']:.1f} tok/s meanwhile, steps "
                    f"{'/'.join(f'{x:.0f}' for x in r['step_ms'])} ms (median/p90/longest)")  # fmt: skip
        if len(r["tries"]) > 1:
            text += f"; every try {', '.join(f'{x:.2f}' for x in r['tries'])} s"
        lines.append(f"| {r['workload']} | {r['engine']} | {text} |")
    print("\n" + "\n".join(lines))
    if args.save:
        print(f"saved {results.save('vllm-serving', chr(10).join(lines))}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
