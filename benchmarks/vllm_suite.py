"""Accuracy on the evaluation suite through vLLM: plain and LeanK, fp32 and fp8 KV, side by side in one run.

    .venv/bin/python benchmarks/vllm_suite.py [--mask hub/smollm2-135m-instruct-s3] [--rule dense-prompt] [--lengths 1024 2048]
        [--samples 25] [--seed 1234] [--tasks ...] [--at 2048:45:niah_single_number,passkey ...]
        [--engines vllm-fp32 vllm-fp8 leank-fp32 leank-fp8] [--threads 2] [--kv-gib 2]
        [--vllm-python .venv-vllm/bin/python] [--json out.json] [--work DIR] [--save]

The probes are the suite's (``leank_train.evaluation.tasks.build_probes``: a probe is a pure function of
seed, task, length and index, so they are the probes ``leank eval`` and ``benchmarks/eval_masks.py`` answer),
tokenized with the served model's chat template in this (the main) environment and written to a JSON file.
Each engine then answers all of them in a fresh process of vLLM's environment, one batched
``LLM.generate`` of the token ids, greedy, each probe with its task's generation budget, on the embedded
SmolLM2-135M-Instruct (the de-quantised copy in ``~/.cache/leank``, offline, fp32 weights) with vLLM's
defaults otherwise (prefix caching and chunked prefill on), ``VLLM_CPU_KVCACHE_SPACE=--kv-gib`` and
``--threads`` unbound OpenMP threads. The engines:

- ``vllm-fp32``: plain vLLM, fp32 KV (``kv_cache_dtype="auto"``), the reference, named ``full`` in the
  suite's table (every paired count there is against it, and its >= 80% tasks make the headline);
- ``vllm-fp8``: plain vLLM, ``kv_cache_dtype="fp8"``;
- ``leank-fp32`` / ``leank-fp8``: the same with the mask, ``additional_config={"leank_mask": --mask}``
  (vLLM serves LeanK's dense-prompt rule unless ``--rule positional``, docs/vllm.md).

The answers (token ids up to the end of sequence) are decoded and scored here with the suite's own
functions (``correct``, ``stats.summarize``, ``report.format_table``): per cell a Wilson interval, paired
counts and McNemar's p against ``full``, the headline over the tasks ``full`` passes. A second table
compares, on the same headline tasks, LeanK fp8 with plain fp8 and with LeanK fp32. ``--at LENGTH:SAMPLES:TASKS``
replaces the tasks and probe count at one length (e.g. only the tasks the full model passes there).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_capacity import model_dir  # noqa: E402

from leank_infer.vllm.settings import SERVED_RULES  # noqa: E402

DEFAULT_MASK = "hub/smollm2-135m-instruct-s3"
#: engine name -> (with the mask, kv_cache_dtype)
ENGINES = {"vllm-fp32": (False, "auto"), "vllm-fp8": (False, "fp8"),
           "leank-fp32": (True, "auto"), "leank-fp8": (True, "fp8")}  # fmt: skip
#: the name the suite's statistics pair everything against
REFERENCE = "vllm-fp32"
#: the comparisons the second table makes (method, against), on the reference's headline tasks
COMPARISONS = (("vllm-fp8", "vllm-fp32"), ("leank-fp32", "vllm-fp32"), ("leank-fp8", "vllm-fp8"),
               ("leank-fp8", "leank-fp32"))  # fmt: skip
#: the headline tasks of the embedded model at 1k on the report seed (docs/evaluation.md)
HEADLINE_1K = ["niah_single_number", "niah_single_uuid", "niah_multikey", "passkey"]


# ------------------------------------------------------------------------------------ main environment


def plan(lengths: list[int], samples: int, tasks: list[str], at: list[str]) -> list[tuple[int, int, list[str]]]:
    """(length, probes per task, tasks) per length: ``lengths`` x ``samples`` x ``tasks``, each
    ``LENGTH:SAMPLES:TASK,TASK`` of ``at`` replacing (or adding) its length."""
    out = {n: (samples, list(tasks)) for n in lengths}
    for item in at:
        length, count, names = item.split(":")
        out[int(length)] = (int(count), names.split(","))
    return [(n, s, t) for n, (s, t) in sorted(out.items())]


def export_probes(tokenizer: Any, runs: list[tuple[int, int, list[str]]], seed: int) -> list[dict[str, Any]]:
    """The suite's probes as the vLLM side needs them: prompt token ids (chat template and answer prefix, as
    ``leank eval`` builds them) and the task's generation budget, with what scoring needs."""
    from leank_train.evaluation.loop import RetrievalEval
    from leank_train.evaluation.tasks import build_probes, chat_ids

    default_budget = RetrievalEval.__init__.__defaults__[0]  # the loop's max_new_tokens (24)
    rows = []
    for length, samples, tasks in runs:
        for p in build_probes(tokenizer, tasks, [length], samples, seed):
            rows.append({"kind": p.kind, "length": p.length, "index": p.index, "haystack": p.haystack,
                         "expected": p.expected, "max_new_tokens": p.max_new_tokens or default_budget,
                         "prompt_token_ids": chat_ids(tokenizer, p.messages, p.answer_prefix)})  # fmt: skip
    return rows


def score(tokenizer: Any, probes: list[dict[str, Any]], generations: dict[str, list[list[int]]],
          eos: set[int]) -> dict[str, Any]:
    """Each engine's answers (token ids per probe, in probe order) decoded and scored as the suite scores
    them; the suite's summary, with :data:`REFERENCE` as ``full``."""
    from leank_train.evaluation.loop import score_answer
    from leank_train.evaluation.stats import summarize

    names = ["full" if e == REFERENCE else e for e in generations]
    answers = []
    for i, p in enumerate(probes):
        row: dict[str, Any] = {k: p[k] for k in ("kind", "length", "haystack", "index", "expected")}
        row.update(tokens=len(p["prompt_token_ids"]), correct={})
        for engine, name in zip(generations, names, strict=True):
            ids = generations[engine][i]
            ids = ids[: next((j for j, t in enumerate(ids) if t in eos), len(ids))][: p["max_new_tokens"]]
            text = tokenizer.decode(ids, skip_special_tokens=True)
            row[name] = text
            row["correct"][name] = bool(score_answer(text, p["expected"]))
        answers.append(row)
    lengths = sorted({p["length"] for p in probes})
    tasks = list(dict.fromkeys(p["kind"] for p in probes))
    return {"methods": names, "lengths": lengths, "answers": answers, **summarize(answers, names, lengths, tasks)}


def compare(res: dict[str, Any], method: str, against: str) -> dict[int, dict[str, Any]]:
    """Paired counts of ``method`` against ``against`` (engine names) per length, summed over the headline
    tasks of that length (those the reference passes), with McNemar's exact p."""
    from leank_train.evaluation.stats import mcnemar_p, paired_counts

    def name(e: str) -> str:
        return "full" if e == REFERENCE else e

    out = {}
    for length, head in res["headline"].items():
        rows = [r for r in res["answers"] if r["length"] == int(length) and r["kind"] in head["tasks"]]
        c = paired_counts([r["correct"][name(against)] for r in rows], [r["correct"][name(method)] for r in rows])
        out[int(length)] = {**c, "mcnemar_p": mcnemar_p(c["only_full"], c["only_method"])}
    return out


def comparison_table(res: dict[str, Any], runs: list[tuple[int, int, list[str]]]) -> str:
    """Per length: the headline of every engine, and the paired comparisons of :data:`COMPARISONS`."""
    engines = [e for e in ENGINES if ("full" if e == REFERENCE else e) in res["methods"]]
    pairs = [(m, a) for m, a in COMPARISONS if m in engines and a in engines]
    per_task = {n: s for n, s, _ in runs}
    lines = ["| length | probes per task | headline tasks | " + " | ".join(engines) + " | "
             + " | ".join(f"{m} vs {a}" for m, a in pairs) + " |",
             "|---" * (3 + len(engines) + len(pairs)) + "|"]  # fmt: skip
    for length, head in sorted(res["headline"].items(), key=lambda kv: int(kv[0])):
        if not head["tasks"]:
            lines.append(f"| {length} | {per_task[int(length)]} | none (the reference passes no task) |"
                         + " |" * (len(engines) + len(pairs)))
            continue
        cells = []
        for e in engines:
            h = head["full" if e == REFERENCE else e]
            cells.append(f"{h['score']:.3f} +/- {h['se']:.3f}")
        for m, a in pairs:
            c = compare(res, m, a)[int(length)]
            cells.append(f"-{c['only_full']}/+{c['only_method']} (p={c['mcnemar_p']:.2g})")
        lines.append(f"| {length} | {per_task[int(length)]} | {', '.join(head['tasks'])} | " + " | ".join(cells) + " |")
    lines += ["", "headline: mean accuracy over the tasks where plain vLLM fp32 (`full`) scores >= 80% at that "
              "length, +/- its standard error; `A vs B`: on those probes, -answers only B got right/+answers only "
              "A got right, exact McNemar p"]  # fmt: skip
    return "\n".join(lines)


def run_engine(args: argparse.Namespace, engine: str, probes_file: Path, out_file: Path) -> dict[str, Any]:
    """One engine in a fresh process of vLLM's environment; its answers and timings."""
    with_mask, dtype = ENGINES[engine]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib), "HF_HUB_OFFLINE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(ROOT),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(args.threads)}  # fmt: skip
    cmd = [args.vllm_python, __file__, "--child", "--probes", str(probes_file), "--out", str(out_file),
           "--kv-dtype", dtype, "--mask", args.mask if with_mask else "", "--rule", args.rule]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if run.returncode or not out_file.exists():
        sys.exit(f"engine {engine} failed:\n{run.stderr[-4000:]}")
    return json.loads(out_file.read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/vllm_suite.py", description=__doc__.splitlines()[0])
    p.add_argument("--mask", default=DEFAULT_MASK)
    p.add_argument("--rule", default=SERVED_RULES[0], choices=SERVED_RULES,
                   help="the rule the LeanK engines serve (additional_config leank_rule)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--samples", type=int, default=25, help="probes per task and length")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tasks", nargs="+", default=HEADLINE_1K)
    p.add_argument("--at", nargs="+", default=[], metavar="LENGTH:SAMPLES:TASK,TASK",
                   help="at LENGTH, SAMPLES probes of these tasks instead")
    p.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    p.add_argument("--threads", type=int, default=2, help="OpenMP threads of each engine (unbound)")
    p.add_argument("--kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--json", type=Path)
    p.add_argument("--save", action="store_true", help="write the tables to docs/results/vllm-suite.json")
    p.add_argument("--work", type=Path, help="keep the probes and each engine's answers here; a rerun of the same "
                   "probes reuses the answers it finds")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--probes", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--kv-dtype", default="auto", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if REFERENCE not in args.engines:
        p.error(f"the engines must include {REFERENCE}, the reference of the suite's statistics")
    cmd = shlex.join([".venv/bin/python", "benchmarks/vllm_suite.py", *argv])
    from transformers import AutoTokenizer

    served = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(served)
    runs = plan(args.lengths, args.samples, args.tasks, args.at)
    probes = export_probes(tokenizer, runs, args.seed)
    eos = {t for t in [tokenizer.eos_token_id] if t is not None}
    gen_eos = json.loads(Path(served, "generation_config.json").read_text()).get("eos_token_id")
    eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    print(f"{len(probes)} probes, longest {max(len(r['prompt_token_ids']) + r['max_new_tokens'] for r in probes)} "
          f"tokens with its answer", flush=True)  # fmt: skip
    generations, seconds = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        probes_file = work / "probes.json"
        text = json.dumps(probes)
        if probes_file.exists() and probes_file.read_text() != text:  # another run's answers: not these probes'
            for old in work.glob("*.json"):
                old.unlink()
        probes_file.write_text(text)
        for engine in [REFERENCE, *(e for e in args.engines if e != REFERENCE)]:
            out_file = (work / f"{engine}-{Path(args.mask).name}-{args.rule}.json" if ENGINES[engine][0]
                        else work / f"{engine}.json")
            if out_file.exists():
                print(f"{engine}: the answers in {out_file}", flush=True)
                out = json.loads(out_file.read_text())
            else:
                out = run_engine(args, engine, probes_file, out_file)
            generations[engine], seconds[engine] = out["token_ids"], out["seconds"]
            print(f"{engine}: {out['seconds'] / 60:.1f} min ({out['kv_cache_tokens']:,} KV tokens)", flush=True)
    from leank_train.evaluation.report import format_table

    res = score(tokenizer, probes, generations, eos)
    tables = "\n".join([
        comparison_table(res, runs), "",
        "Per task (cells: correct/probes, accuracy, Wilson 95% interval, paired counts against `full`, plain vLLM "
        "with fp32 KV):", "",
        format_table(res), "",
        f"mask {args.mask}, rule {args.rule}; embedded SmolLM2-135M-Instruct, fp32 weights, vLLM defaults, {args.threads} threads, "
        f"{os.cpu_count()} CPUs; " + ", ".join(f"{e} {s / 60:.1f} min" for e, s in seconds.items()),
    ])  # fmt: skip
    print(f"\n`{cmd}`\n")
    print(tables)
    if args.save:
        import results

        print(f"saved {results.save('vllm-suite', tables)}")
    if args.json:
        args.json.write_text(json.dumps({"command": cmd, "seconds": seconds, "mask": args.mask, **res},
                                        indent=1, default=str))  # fmt: skip


# ------------------------------------------------------------------------------------ vLLM environment


def child(args: argparse.Namespace) -> None:
    """One engine answers every probe in one batched generate; writes the token ids and timings."""
    from vllm import LLM, SamplingParams, TokensPrompt

    probes = json.loads(args.probes.read_text())
    longest = max(len(r["prompt_token_ids"]) + r["max_new_tokens"] for r in probes)
    extra = {"additional_config": {"leank_mask": args.mask, "leank_rule": args.rule}} if args.mask else {}
    start = time.perf_counter()
    llm = LLM(model=model_dir(), dtype="float32", max_model_len=longest, kv_cache_dtype=args.kv_dtype, **extra)
    ready = time.perf_counter()
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in probes]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_new_tokens"]) for r in probes]
    outs = llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - ready
    cache = llm.llm_engine.vllm_config.cache_config
    args.out.write_text(json.dumps({
        "token_ids": [list(o.outputs[0].token_ids) for o in outs], "seconds": took, "start_seconds": ready - start,
        "kv_cache_tokens": cache.kv_cache_size_tokens,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
