"""Speculative decoding in vLLM with and without LeanK: n-gram drafts, tokens per second and acceptance.

    .venv-vllm/bin/python benchmarks/vllm_speculative.py [--mask hub/smollm2-135m-instruct-s3] [--context 2048]
        [--batch 4] [--new-tokens 64] [--spec-tokens 3] [--threads 2] [--repeats 2] [--prefix-align N] [--save]

Four engines per repeat, each fresh in its own process and alternating: plain vLLM and LeanK (the default rule),
each without and with vLLM's n-gram speculation (``speculative_config={"method": "ngram", ...}``). Each engine
gets the same ``--batch`` prompts of about ``--context`` tokens (Python documentation text, then a request to
repeat its first paragraph: text the n-gram drafter can find in the prompt), computes them once (not timed,
``max_tokens=1``), then generates ``--new-tokens`` greedy tokens per request over the cached prompts (timed: the
prompt is a prefix-cache hit, so the time is decode). Reported per side: generated tokens per second (the
fastest of the repeats), the speed-up speculation gives, the share of draft tokens accepted, the engine's steps and
its time per step, and whether the greedy tokens with speculation equal those without; then, per request, the share
of its greedy output's 3-grams found in its prompt (n-gram drafts come from the prompt, so a side whose output copies
less gets fewer drafts and more steps). The last thing printed is a markdown table.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import results  # noqa: E402
from vllm_capacity import model_dir  # noqa: E402


def prompts(context: int, batch: int) -> list[list[int]]:
    """``batch`` prompts of ``context`` tokens: documentation text, then an instruction to repeat it."""
    import pydoc_data.topics

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir())
    text = " ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tok(text).input_ids
    ask = tok("\n\nRepeat the first paragraph above word for word.").input_ids
    n = context - len(ask)
    return [ids[1000 * i : 1000 * i + n] + ask for i in range(batch)]


def _counters(llm) -> dict:  # noqa: ANN001
    """The draft counters, and the engine's steps (the count of its tokens-per-iteration histogram)."""
    wanted = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
    got = {m.name: m.value for m in llm.get_metrics() if m.name in wanted}
    got["steps"] = sum(m.count for m in llm.get_metrics() if m.name == "vllm:iteration_tokens_total")
    return got


def copied(prompt: list[int], out: list[int], n: int = 3) -> float:
    """The share of the output's ``n``-grams found in its prompt: what an n-gram drafter can propose from."""
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    outs = [tuple(out[i : i + n]) for i in range(len(out) - n + 1)]
    return sum(g in grams for g in outs) / max(1, len(outs))


def child(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    extra = {"additional_config": {"leank_mask": args.mask}} if args.mask else {}
    if args.mask and args.prefix_align:
        extra["additional_config"]["leank_prefix_align"] = args.prefix_align
    if args.spec_tokens:
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.spec_tokens,
                                       "prompt_lookup_max": 4, "prompt_lookup_min": 2}  # fmt: skip
    llm = LLM(model=model_dir(), dtype="float32", max_model_len=args.context + args.new_tokens + 16,
              max_num_seqs=args.batch, disable_log_stats=False, **extra)  # fmt: skip
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(args.context, args.batch)]
    llm.generate(
        batch, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False
    )  # prompts computed, cached
    before = _counters(llm)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    after = _counters(llm)
    drafts = after.get("vllm:spec_decode_num_draft_tokens", 0) - before.get(
        "vllm:spec_decode_num_draft_tokens", 0
    )
    accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
        "vllm:spec_decode_num_accepted_tokens", 0
    )
    print("RESULT " + json.dumps({
        "tok_s": args.batch * args.new_tokens / seconds, "drafts": drafts, "accepted": accepted,
        "steps": after["steps"] - before["steps"], "seconds": seconds,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }), flush=True)  # fmt: skip


def engine(args: argparse.Namespace, mask: str, spec_tokens: int) -> dict:
    """:func:`child` in a fresh process (vLLM's state is per process)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(ROOT),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(args.threads),
           "VLLM_CPU_KVCACHE_SPACE": "1"}  # fmt: skip
    cmd = [sys.executable, __file__, "--child", "--mask", mask, "--spec-tokens", str(spec_tokens),
           "--context", str(args.context), "--batch", str(args.batch), "--new-tokens", str(args.new_tokens)]  # fmt: skip
    if args.prefix_align:
        cmd += ["--prefix-align", str(args.prefix_align)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not line:
        raise SystemExit(
            f"engine failed ({mask or 'plain'}, speculation {spec_tokens}):\n{out.stderr[-4000:]}"
        )
    return json.loads(line[-1][7:])


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python benchmarks/vllm_speculative.py", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--mask", default=str(ROOT / "hub" / "smollm2-135m-instruct-s3"), help="LeanK's mask folder"
    )
    p.add_argument("--context", type=int, default=2048, help="prompt tokens per request")
    p.add_argument("--batch", type=int, default=4, help="requests decoded together")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated per request (timed)")
    p.add_argument(
        "--spec-tokens", type=int, default=3, help="n-gram draft tokens per step (num_speculative_tokens)"
    )
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each engine")
    p.add_argument(
        "--repeats", type=int, default=2, help="fresh engines per configuration, all four alternating"
    )
    p.add_argument(
        "--save", action="store_true", help="write the table to docs/results/vllm-speculative.json"
    )
    p.add_argument(
        "--prefix-align", type=int, default=None, help="LeanK's leank_prefix_align (default: the plugin's)"
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    sides = {"plain": "", "LeanK": str(Path(args.mask).resolve())}
    tries: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.repeats):
        for name, mask in sides.items():
            for spec in (0, args.spec_tokens):
                rec = engine(args, mask, spec)
                tries.setdefault((name, spec), []).append(rec)
                print(f"try {r + 1}: {name}, speculation {spec}: {rec['tok_s']:.1f} tokens/s", flush=True)
    best = {k: max(v, key=lambda x: x["tok_s"]) for k, v in tries.items()}
    lines = [
        f"{args.batch} requests of {args.context} prompt tokens, {args.new_tokens} greedy tokens each, n-gram drafts "
        f"of {args.spec_tokens} tokens, {args.threads} threads, fp32; mask `{Path(args.mask).name}`; fastest of "
        f"{args.repeats} fresh engines per row, the four alternating.",
        "",
        "| engine | speculation | tokens/s | vs plain, same speculation | speed-up from speculation "
        "| drafts accepted | engine steps | ms per step | same tokens as without |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in sides:
        for spec in (0, args.spec_tokens):
            rec, base = best[(name, spec)], best[(name, 0)]
            vs = rec["tok_s"] / best[("plain", spec)]["tok_s"]
            acc = (
                f"{rec['accepted'] / rec['drafts']:.0%} ({rec['accepted']}/{rec['drafts']})" if spec else "-"
            )
            same = ("yes" if rec["tokens"] == base["tokens"] else "NO") if spec else "-"
            lines.append(f"| {name} | {spec or 'off'} | {rec['tok_s']:.1f} | {vs:.2f}x | "
                         f"{rec['tok_s'] / base['tok_s']:.2f}x | {acc} | {rec['steps']} | "
                         f"{1e3 * rec['seconds'] / max(1, rec['steps']):.1f} | {same} |")  # fmt: skip
    asked = prompts(args.context, args.batch)
    lines += ["", "Share of each request's greedy 3-grams found in its prompt (what n-gram drafts can propose from): "
              + "; ".join(f"{name} " + ", ".join(f"{copied(p, o):.0%}" for p, o in zip(asked, best[(name, 0)]["tokens"],
                                                                                    strict=True))
                          for name in sides) + "."]  # fmt: skip
    print("\n" + "\n".join(lines))
    if args.save:
        print(f"saved {results.save('vllm-speculative', chr(10).join(lines))}")


if __name__ == "__main__":
    main()
