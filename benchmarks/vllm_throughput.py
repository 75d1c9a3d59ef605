"""Decode throughput of vLLM vs vLLM + LeanK in the same KV memory, prefill kept out of the timing.

    .venv-vllm/bin/python benchmarks/vllm_throughput.py [--mask hub/smollm2-135m-instruct]
        [--kv-mib 1024] [--contexts 4096 8192] [--steps 12] [--json out.json]

Each engine (plain, then LeanK) runs in a fresh process (in-process engine core) on the embedded
SmolLM2 (the de-quantised copy in ~/.cache/leank, offline), fp32, with ``kv_cache_memory_bytes =
--kv-mib`` MiB. Per context C it submits more requests of C - 2 * steps - 4 prompt tokens than the
pool holds and drives the engine one ``step()`` at a time, timing every step (wall clock and the
process's CPU time):

- max concurrent sequences: how many requests vLLM actually runs at once (the rest wait), next to
  the concurrency vLLM reports at start-up for C-token requests;
- decode at max concurrency: ``running / median step time`` over ``--steps`` pure decode steps
  (steps that hold a prefill are left out: vLLM prefills without chunking here, so a step is either
  all prefill + first tokens or all decode);
- decode at the same batch: the engine then aborts requests down to the batch plain vLLM fits and
  times ``--steps`` more decode steps: the per-sequence cost, like for like.

Medians and CPU time keep the figures steady on a shared machine (another process's burst lengthens
a step's wall time, not its CPU time). The last thing printed is a markdown table.
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

from vllm_capacity import model_dir  # noqa: E402

MAX_SEQS = 16


def child(args: argparse.Namespace) -> None:
    """One engine at one context: the step timings; prints one JSON line."""
    from vllm import LLM, SamplingParams, TokensPrompt

    extra: dict = {"additional_config": {"leank_mask": args.mask}} if args.mask else {}
    if args.mask and args.any_base_model:
        extra["additional_config"]["leank_check_base_model"] = False
    if args.attention_backend:
        extra["attention_backend"] = args.attention_backend
    if args.load_format == "dummy":  # random weights from a config folder: no tokenizer needed, ids are given
        extra.update(load_format="dummy", skip_tokenizer_init=True)
    llm = LLM(
        model=args.model or model_dir(),
        dtype=args.dtype,
        max_model_len=args.context,
        max_num_batched_tokens=args.context * MAX_SEQS,
        max_num_seqs=MAX_SEQS,
        enforce_eager=True,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        kv_cache_memory_bytes=args.kv_mib * 2**20,
        **extra,
    )
    cache = llm.llm_engine.vllm_config.cache_config
    reported = cache.kv_cache_max_concurrency
    engine = llm.llm_engine
    submit = min(MAX_SEQS, int(reported) + 1)  # one more than fits: it waits
    prompt_len = args.context - 2 * args.steps - 4  # room for both phases' tokens
    params = SamplingParams(temperature=0.0, max_tokens=2 * args.steps + 2, ignore_eos=True)
    rids = []  # the engine's own (internal) request ids, in submission order
    for i in range(submit):
        ids = [(17 * i + 31 * j) % 20000 + 100 for j in range(prompt_len)]
        rids.append(engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids), params))

    def timed_steps(n: int) -> tuple[list[float], list[float], list[int]]:
        wall, cpu, running = [], [], []
        for _ in range(4 * n + 8):
            if len(wall) == n:
                break
            w, c = time.perf_counter(), time.process_time()
            outs = engine.step()
            w, c = time.perf_counter() - w, time.process_time() - c
            if any(len(o.outputs[0].token_ids) == 1 for o in outs) or not outs:
                continue  # a prefill step (or an empty one): not decode
            wall.append(w)
            cpu.append(c)
            running.append(len(outs))
        else:
            raise RuntimeError(f"only {len(wall)} of {n} decode steps came")
        return wall, cpu, running

    t0 = time.perf_counter()
    full = timed_steps(args.steps)
    out = {
        "engine": "leank" if args.mask else "plain",
        "context": args.context,
        "kv_mib": args.kv_mib,
        "kv_cache_tokens": cache.kv_cache_size_tokens,
        "reported_concurrency": reported,
        "submitted": submit,
        "running": max(full[2]),
        "full": summarise(*full),
    }
    batch = args.same_batch or out["running"]
    engine.abort_request(rids[batch:], internal=True)  # first come, first served: the later ones wait
    out["same_batch"] = summarise(*timed_steps(args.steps))
    out["same_batch"]["batch"] = batch
    out["total_s"] = time.perf_counter() - t0
    engine.abort_request(rids[:batch], internal=True)
    print("RESULT " + json.dumps(out), flush=True)


def summarise(wall: list[float], cpu: list[float], running: list[int]) -> dict[str, float]:
    """Decode tokens/s from the median step (wall and CPU), with the running count of those steps."""
    n = statistics.median(running)
    return {
        "steps": len(wall),
        "running": n,
        "step_ms": 1e3 * statistics.median(wall),
        "step_cpu_ms": 1e3 * statistics.median(cpu),
        "tok_s": n / statistics.median(wall),
        "tok_cpu_s": n / statistics.median(cpu),
    }


def run_child(args: argparse.Namespace, context: int, mask: str, same_batch: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    # unbound OpenMP threads: vLLM's default binds (and spins) them on every core, which on a shared
    # machine turns another process's burst into seconds of stall per step
    env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, __file__, "--child", "--context", str(context), "--mask", mask,
           "--kv-mib", str(args.kv_mib), "--steps", str(args.steps), "--same-batch", str(same_batch),
           "--model", args.model, "--dtype", args.dtype, "--load-format", args.load_format,
           "--attention-backend", args.attention_backend] + (["--any-base-model"] if args.any_base_model else [])  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    if run.returncode or not line:
        raise SystemExit(f"engine failed ({'leank' if mask else 'plain'}, {context}):\n{run.stderr[-4000:]}")
    return json.loads(line[-1][7:])


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python benchmarks/vllm_throughput.py", description=__doc__.splitlines()[0]
    )
    p.add_argument("--mask", default=str(ROOT / "hub" / "smollm2-135m-instruct"))
    p.add_argument("--kv-mib", type=int, default=1024, help="kv_cache_memory_bytes, in MiB")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per phase")
    p.add_argument("--threads", type=int, default=1, help="OpenMP threads per engine (unbound)")
    p.add_argument("--json", type=Path)
    p.add_argument("--model", default="", help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--load-format", default="auto", help="'dummy': random weights from --model's config.json")
    p.add_argument("--attention-backend", default="", help="e.g. TRITON_ATTN on a GPU (LeanK's CUDA backend)")
    p.add_argument("--any-base-model", action="store_true", help="serve the mask on a model of another name")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)
    p.add_argument("--same-batch", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return []
    rows = []
    start = time.perf_counter()
    for context in args.contexts:
        plain = run_child(args, context, "", 0)
        rows += [plain, run_child(args, context, args.mask, plain["running"])]
    model = args.model or "embedded SmolLM2-135M-Instruct"
    mask = Path(args.mask)
    shown = mask.relative_to(ROOT) if mask.is_absolute() and mask.is_relative_to(ROOT) else mask
    print(f"{model}, {args.dtype}, KV memory {args.kv_mib} MiB, mask {shown}; "
          f"{args.threads} thread(s) of {os.cpu_count()} CPUs; {time.perf_counter() - start:.0f} s")  # fmt: skip
    print(
        "| context | engine | KV tokens (vLLM) | concurrency reported | seqs running | decode tok/s at max "
        "(CPU-time tok/s) | batch | decode tok/s at that batch (CPU-time tok/s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        f, s = r["full"], r["same_batch"]
        print(f"| {r['context']} | {r['engine']} | {r['kv_cache_tokens']:,} | {r['reported_concurrency']:.2f} | "
              f"{r['running']} | {f['tok_s']:.1f} ({f['tok_cpu_s']:.1f}) | {s['batch']} | "
              f"{s['tok_s']:.1f} ({s['tok_cpu_s']:.1f}) |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
