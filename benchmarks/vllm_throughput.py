"""Decode throughput of plain vLLM vs vLLM + LeanK: at equal batches and at each engine's maximum concurrency.

    .venv-vllm/bin/python benchmarks/vllm_throughput.py [--mask hub/smollm2-135m-instruct-s3] [--rule dense-prompt]
        [--contexts 2048 8192] [--batches 1 4 16] [--threads 1 2] [--steps 8] [--repeats 1] [--cap-gib 4]
        [--phases equal max] [--json out.json] [--save]

The embedded SmolLM2-135M-Instruct (the de-quantised copy in ``~/.cache/leank``, offline), fp32, vLLM's
defaults otherwise; every engine in a fresh process with ``OMP_NUM_THREADS`` threads (unbound:
``VLLM_CPU_OMP_THREADS_BIND=nobind``, so that a shared machine's other jobs stall a step less). Per
context C and thread count, for each side:

- **equal batch**: a KV pool just large enough for plain vLLM to hold the largest batch (at most
  ``--cap-gib``; batches that do not fit it are skipped), then for each batch B: B requests of
  C - 4 * steps - 12 tokens are prefilled (not timed) and ``--steps`` pure decode steps are timed;
  ``--repeats`` fresh engines per side, plain and LeanK alternating, each row the fastest of its side's
  (one engine process and the next decode up to ~1.4x apart on the same machine: see :func:`best_of`);
- **max concurrency** (``--phases max``; both phases by default): a 1 GiB pool; more requests than it holds are submitted and the pure decode steps of
  whatever vLLM runs at once are timed (the rest wait).

A pure decode step is one whose running requests are all past their prompts and that admits no request:
under chunked prefill a step that also runs a prefill chunk still returns the decoders' tokens, and timing
it would charge the prefill to decode (the engine holding more requests admits more, so this would fall
on LeanK's side).

A figure is running requests over the median step time (wall clock and the process's CPU time). The last
thing printed is a markdown table with LeanK's tokens/s over plain's.
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

DENSE_TOKEN_BYTES = 2 * 30 * 3 * 64 * 4  # the embedded model's K+V per token, fp32
CONTEXTS = (2048, 8192)  # a default run's contexts and phases: the docs' fuller tables
PHASES = ("equal", "max")


def _scheduler(engine):  # noqa: ANN001, ANN202 - the in-process engine core's scheduler
    return engine.engine_core.engine_core.scheduler


def decode_steps(engine, n: int) -> dict:  # noqa: ANN001
    """Time ``n`` pure decode steps: every running request past its prompt before the step and no request
    admitted by it (a step that also runs a prefill chunk, of a running or a newly admitted request, is
    skipped; under chunked prefill such a step still returns the decoders' tokens)."""
    sched = _scheduler(engine)
    wall, cpu, running = [], [], []
    for _ in range(8 * n + 256):
        if len(wall) == n:
            break
        before = {r.request_id for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens}
        decoding = bool(before) and len(before) == len(sched.running)
        w, c = time.perf_counter(), time.process_time()
        outs = engine.step()
        w, c = time.perf_counter() - w, time.process_time() - c
        if not decoding or not {r.request_id for r in sched.running} <= before or not outs:
            continue
        wall.append(w)
        cpu.append(c)
        running.append(len(outs))
    if len(wall) < n:
        raise RuntimeError(f"only {len(wall)} of {n} decode steps came")
    b = statistics.median(running)
    return {"running": b, "tok_s": b / statistics.median(wall), "tok_cpu_s": b / statistics.median(cpu)}


def child(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    extra = {"additional_config": {"leank_mask": args.mask, "leank_rule": args.rule}} if args.mask else {}
    llm = LLM(model=model_dir(), dtype="float32", max_model_len=args.context, max_num_seqs=max(args.batches + [64]),
              kv_cache_memory_bytes=args.kv_bytes, **extra)  # fmt: skip
    engine = llm.llm_engine
    prompt = args.context - 4 * args.steps - 12
    # long enough that no request of the timed set finishes (and frees room for a prefill) while it is timed
    params = SamplingParams(temperature=0.0, max_tokens=4 * args.steps + 8, ignore_eos=True)
    rows, counter = [], 0
    plan = args.batches if args.phase == "equal" else [0]
    for b in plan:
        submit = b or 64  # max concurrency: more than any pool here holds
        rids = []
        for _ in range(submit):
            counter += 1
            ids = [(17 * counter + 31 * j) % 20000 + 100 for j in range(prompt)]
            rids.append(engine.add_request(str(counter), TokensPrompt(prompt_token_ids=ids), params))
        row = decode_steps(engine, args.steps)
        row.update(batch=b or "max", context=args.context)
        rows.append(row)
        engine.abort_request(rids, internal=True)
        while engine.has_unfinished_requests():
            engine.step()
    print("RESULT " + json.dumps(rows), flush=True)


def run(args: argparse.Namespace, mask: str, context: int, threads: int, phase: str, batches: list[int], kv: int) -> list:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(ROOT),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}  # fmt: skip
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    cmd = [sys.executable, __file__, "--child", "--mask", mask, "--context", str(context), "--phase", phase,
           "--kv-bytes", str(kv), "--steps", str(args.steps), "--rule", args.rule,
           "--batches", *map(str, batches or [0])]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not line:
        raise SystemExit(f"engine failed ({mask or 'plain'}, {context}, {phase}):\n{out.stderr[-4000:]}")
    rows = json.loads(line[-1][7:])
    for r in rows:
        r.update(engine="leank" if mask else "plain", threads=threads)
    return rows


def best_of(tries: list[dict]) -> list[dict]:
    """One row per (engine, threads, context, batch): the fastest of its fresh engines, every try's tokens/s kept.

    The same engine started twice on the same machine decodes at speeds up to ~1.4x apart (the model's matmuls,
    half of a step at small batches, vary most), so one engine per side compares two draws of that spread."""
    return results.best_of(
        tries, lambda r: (r["engine"], r["threads"], r["context"], r["batch"]), lambda r: r["tok_s"], higher=True
    )


def _tries(plain: dict, leank: dict) -> str:
    if not plain.get("tries"):
        return ""
    return " / ".join(", ".join(f"{x:.1f}" for x in side["tries"]) for side in (plain, leank))


def result_name(threads: int, phases: list[str] | tuple[str, ...] = PHASES,
                contexts: list[int] | tuple[int, ...] = CONTEXTS) -> str:
    """The docs' table of one thread count: ``docs/results/vllm-throughput-<N>-thread(s).json``, with ``-equal`` or
    ``-max`` for a run of one phase and ``-2k``/``-8k`` for a run of one context before ``.json`` (so that a partial
    run replaces no fuller table)."""
    one = "" if set(phases) == set(PHASES) else f"-{phases[0]}"
    some = "" if set(contexts) == set(CONTEXTS) else "".join(f"-{c // 1024}k" if c % 1024 == 0 else f"-{c}" for c in contexts)
    return f"vllm-throughput-{threads}-thread{'s' if threads > 1 else ''}{one}{some}"


def table(rows: list[dict], mask: str, threads: int, repeats: int = 1) -> str:
    """The markdown table of one thread count's rows: LeanK's tokens/s over plain's at each context and batch."""
    path = Path(mask).resolve()
    lines = [
        f"Embedded SmolLM2-135M-Instruct, fp32, mask {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}, "
        f"vLLM's defaults, {threads} thread{'s' if threads > 1 else ''}; decode tokens/s over the wall clock "
        "(over the process's CPU time in brackets)"
        + (f"; equal batches: the fastest of {repeats} fresh engines per side, the sides alternating." if repeats > 1
           else "."),
        "",
        "| threads | context | batch | plain tok/s | LeanK tok/s | LeanK / plain |" + (" every try, plain / LeanK |" if repeats > 1 else ""),
        "|---|---|---|---|---|---|" + ("---|" if repeats > 1 else ""),
    ]
    for r in (r for r in rows if r["engine"] == "plain" and r["threads"] == threads):
        other = [x for x in rows if x["engine"] == "leank" and (x["threads"], x["context"], x["batch"]) ==
                 (r["threads"], r["context"], r["batch"])]  # fmt: skip
        if not other:
            continue
        o = other[0]
        batch = f"max ({r['running']:.0f} vs {o['running']:.0f})" if r["batch"] == "max" else r["batch"]
        lines.append(f"| {r['threads']} | {r['context']} | {batch} | {r['tok_s']:.1f} ({r['tok_cpu_s']:.1f}) | "
                     f"{o['tok_s']:.1f} ({o['tok_cpu_s']:.1f}) | {o['tok_s'] / r['tok_s']:.2f}x |"
                     + (f" {_tries(r, o)} |" if repeats > 1 else ""))  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/vllm_throughput.py", description=__doc__.splitlines()[0])
    p.add_argument("--mask", default=str(ROOT / "hub" / "smollm2-135m-instruct-s3"))
    p.add_argument("--rule", default=SERVED_RULES[0], choices=SERVED_RULES,
                   help="the rule the LeanK engine serves (additional_config leank_rule)")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1,
                   help="fresh engines per side at equal batches (alternating sides); each row is the fastest")
    p.add_argument("--cap-gib", type=float, default=4.0, help="largest KV pool of an equal-batch engine")
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES,
                   help="equal batches, maximum concurrency, or both; a table without both saves as its own result")
    p.add_argument("--json", type=Path)
    p.add_argument("--save", action="store_true",
                   help="write each thread count's table to docs/results/vllm-throughput-<N>-thread(s).json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--kv-bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    rows = []
    for threads in args.threads:
        for context in args.contexts:
            fits = [b for b in args.batches if b * (context + 64) * DENSE_TOKEN_BYTES <= args.cap_gib * 2**30]
            kv = int(max(fits) * (context + 64) * DENSE_TOKEN_BYTES * 1.1) if fits else 0
            tries = []  # equal batches: --repeats fresh engines per side, the sides alternating
            for _ in range(args.repeats if fits and "equal" in args.phases else 0):
                for mask in ("", args.mask):
                    tries += run(args, mask, context, threads, "equal", fits, kv)
                    print(tries[-1], flush=True)
            rows += best_of(tries)
            for mask in ("", args.mask) if "max" in args.phases else ():
                rows += run(args, mask, context, threads, "max", [], 2**30)
                print(rows[-1], flush=True)
    tables = {t: table(rows, args.mask, t, args.repeats) for t in args.threads}
    print("\n" + "\n\n".join(tables.values()))
    if args.save:  # one table per thread count, so that a rerun of one thread count replaces only its own
        for t, text in tables.items():
            print(f"saved {results.save(result_name(t, args.phases, args.contexts), text)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
