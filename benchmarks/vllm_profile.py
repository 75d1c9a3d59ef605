"""Where a decode step's time goes, plain vLLM and vLLM + LeanK: per side ``--repeats`` fresh engines (the sides
alternating), a batch prefilled, decode steps timed and then profiled (cProfile), the attention path split from the
rest; each side's row is its engine with the fastest unprofiled step, every engine's step in the last column.

    .venv-vllm/bin/python benchmarks/vllm_profile.py [--mask hub/smollm2-135m-instruct-s3] [--batch 1]
        [--context 2048] [--threads 2] [--steps 20] [--repeats 1] [--top 15] [--save] [--dump /tmp/prof]

The embedded SmolLM2-135M-Instruct (offline), fp32, vLLM's defaults, each engine in a process of its own
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``OMP_NUM_THREADS=--threads`` unbound. Each side prints the median wall
time of
``--steps`` unprofiled decode steps, then per profiled step: the attention op as vLLM calls it for every layer
(``unified_attention_with_output`` and, for plain vLLM, its separate ``unified_kv_cache_update``), the attention
kernel inside it (vLLM's ``cpu_attention_with_kv_cache`` or LeanK's ``cpu_decode.LayerKernel.decode``), and what
is left around the kernel (the page write, views, argument building: Python per layer); then the functions with
the most time of their own. The last thing printed is a markdown table of both sides (``--save``: for the docs).
``--dump``: each side's whole profile as a pstats file, to compare function by function (the last engine's).
Fresh engines of one side run up to ~1.4x apart on a small shared machine; ``--repeats 3`` keeps one slow engine
from deciding the table.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import results  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/vllm_profile.py", description=__doc__.splitlines()[0])
    p.add_argument("--mask", default=str(ROOT / "hub" / "smollm2-135m-instruct-s3"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=1, help="fresh engines per side, alternating; the fastest is shown")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--save", action="store_true", help="write the table to docs/results/vllm-profile.json")
    p.add_argument("--dump", help="also write each side's profile (pstats) to DUMP-plain.prof / DUMP-leank.prof")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.child:
        return parent(args)
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind",
                      OMP_NUM_THREADS=str(args.threads))  # fmt: skip
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm_capacity import model_dir
    from vllm_throughput import DENSE_TOKEN_BYTES

    extra = {"additional_config": {"leank_mask": args.mask}} if args.mask else {}
    kv = int(max(4, args.batch) * (args.context + 64) * DENSE_TOKEN_BYTES * 1.1)  # plain's rows, some room
    llm = LLM(model=model_dir(), dtype="float32", max_model_len=args.context, max_num_seqs=64,
              kv_cache_memory_bytes=kv, **extra)  # fmt: skip
    engine = llm.llm_engine
    new = 2 * args.steps + 8
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i in range(args.batch):
        ids = [(17 * (i + 1) + 31 * j) % 20000 + 100 for j in range(args.context - new - 4)]
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids), params)
    sched = engine.engine_core.engine_core.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    plain = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        plain.append(1e3 * (time.perf_counter() - t))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    prof.disable()
    if args.dump:
        prof.dump_stats(f"{args.dump}-{'leank' if args.mask else 'plain'}.prof")
    stats = pstats.Stats(prof)

    def cum_ms(name: str, file_part: str = "") -> float:
        return sum(v[3] for k, v in stats.stats.items() if k[2] == name and file_part in k[0]) * 1e3 / args.steps

    def builtin_ms(name: str) -> float:
        return sum(v[3] for k, v in stats.stats.items() if k[0] == "~" and name in k[2]) * 1e3 / args.steps

    attention = cum_ms("unified_attention_with_output") + cum_ms("unified_kv_cache_update")
    kernel = cum_ms("decode", "cpu_decode.py") if args.mask else builtin_ms("cpu_attention_with_kv_cache")
    stats.sort_stats("tottime").print_stats(args.top)
    row = {"side": "LeanK" if args.mask else "plain", "step_ms": statistics.median(plain), "attention_ms": attention,
           "kernel_ms": kernel}  # fmt: skip
    print("RESULT " + json.dumps(row), flush=True)


def parent(args: argparse.Namespace) -> None:
    tries = []
    for mask in [side for _ in range(args.repeats) for side in ("", args.mask)]:
        cmd = [sys.executable, __file__, "--child", "--mask", mask, "--batch", str(args.batch), "--context",
               str(args.context), "--threads", str(args.threads), "--steps", str(args.steps), "--top", str(args.top),
               *(["--dump", args.dump] if args.dump else [])]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
        if run.returncode or not line:
            sys.exit(f"engine failed ({mask or 'plain'}):\n{run.stderr[-4000:]}")
        print(run.stdout[run.stdout.find("   Ordered by") :].split("RESULT ")[0])  # the side's top functions
        tries.append(json.loads(line[-1][7:]))
    text = table(tries, args)
    print(text)
    if args.save:
        print(f"saved {results.save('vllm-profile', text)}")


def table(tries: list[dict], args: argparse.Namespace) -> str:
    """The markdown table: per side its engine with the fastest unprofiled step (every engine's step beside it)."""
    rows = results.best_of(tries, lambda r: (r["side"],), lambda r: r["step_ms"], higher=False)
    many = args.repeats > 1
    mask = Path(args.mask).resolve()
    lines = [
        f"Embedded SmolLM2-135M-Instruct, fp32, mask {mask.relative_to(ROOT) if mask.is_relative_to(ROOT) else mask}, "
        f"vLLM's defaults, batch {args.batch} at {args.context} tokens, {args.threads} threads; a decode step's median "
        f"wall time over {args.steps} steps, then per step under cProfile (which slows Python most) the 30 layers' "
        "attention ops, the attention kernel inside them and what is around it"
        + (f"; the fastest of {args.repeats} fresh engines per side, the sides alternating." if many else "."),
        "",
        "| engine | step (ms) | attention, profiled (ms) | its kernel (ms) | around the kernel (ms) |"
        + (" every engine's step (ms) |" if many else ""),
        "|---|---|---|---|---|" + ("---|" if many else ""),
        *(f"| {r['side']} | {r['step_ms']:.1f} | {r['attention_ms']:.1f} | {r['kernel_ms']:.1f} | "
          f"{r['attention_ms'] - r['kernel_ms']:.1f} |" + (f" {', '.join(f'{t:.1f}' for t in r['tries'])} |" if many else "")
          for r in rows),
    ]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
