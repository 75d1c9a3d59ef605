"""Several masks of one base model and the baselines at each one's budget, on the same suite probes, in one pass.

``leank eval MASK`` answers with the full model, one learned mask and the two baselines at its budget;
``leank eval A B`` sweeps masks without baselines. Here every probe is prefilled once (dense, shared) and
then decoded by the full model, each learned mask (``leank-r70``: the mask of ratio 0.7) and, per mask,
random and ThinK channels at its K budget (``random-r70``, ``think-r70``), so all of them are paired with
the full model on the same probes. Prints the suite table (``leank_train.evaluation.report``), and the
time taken. ``--card`` rewrites each mask's model card with its own rows (the full model, the mask as
``leank``, and the baselines at its budget as ``random`` and ``think``), this command next to them.
``--rules dense-prefill positional`` answers with each mask (and baseline) under each LeanK rule on the same
probes: the first rule's methods keep the names above, the others' get the rule as a suffix
(``leank-r70-positional``); the cards take the first rule's.
``--from-json F --card`` writes the cards from a run saved with ``--json F`` (same masks, same order), next to
the command that measured them, without answering again.

KV quantisation (issue #33), on the same probes: ``--kv-quants int8 int4`` adds each mask with its middle quantised
(``leank-r70-int8``), ``--random-kv-quants int8`` random channels at its budget, quantised the same way
(``random-r70-int8``: the same bytes), ``--hf-quants quanto:4 quanto:2`` transformers' ``QuantizedCache`` alone
(``quanto-int4``: every channel, quantised). Every method's KV bytes per token after a prefill of ``--bytes-at``
tokens (bf16 model dtype) go into the JSON and the table; ``--plot F.png`` draws them against the headline score.

    python benchmarks/eval_masks.py hub/smollm2-135m-instruct hub/smollm2-135m-instruct-r80 \
        --lengths 1024 2048 --samples 20 --seed 7 [--tasks ...] [--no-baselines] [--json out.json] [--card]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from leank_infer import ChannelMask, LeanKModel
from leank_infer.decode.rule import DENSE_PREFILL, RULES
from leank_infer.hub.card import write_model_card
from leank_train.evaluation.loop import evaluate
from leank_train.evaluation.methods import Full, Learned, QuantizedKV, RandomChannels, ThinK
from leank_train.evaluation.report import card_results, format_table, renamed
from leank_train.evaluation.settings import TASK_NAMES


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("masks", nargs="+")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tasks", nargs="+", default=list(TASK_NAMES))
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rules", nargs="+", choices=RULES, default=[DENSE_PREFILL],
                   help="LeanK rules to answer with (each mask and baseline once per rule)")
    p.add_argument("--kv-quants", nargs="+", default=[], choices=["int8", "int4"],
                   help="also each mask with its middle quantised (LeanK + kv_quant)")
    p.add_argument("--random-kv-quants", nargs="+", default=[], choices=["int8", "int4"],
                   help="also random channels at each mask's budget, middle quantised")
    p.add_argument("--hf-quants", nargs="+", default=[],
                   help="BACKEND:BITS of transformers' QuantizedCache alone (e.g. quanto:4 quanto:2)")
    p.add_argument("--bytes-at", type=int, default=8192, help="tokens at which KV bytes per token are reported")
    p.add_argument("--plot", type=Path, default=None, help="bytes per token vs headline score (Pareto figure)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--card", action="store_true", help="rewrite each mask's model card with its rows")
    p.add_argument("--from-json", type=Path, default=None,
                   help="no evaluation: the results of an earlier run's --json (the same masks in the same order)")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    cmd = shlex.join(["python", "benchmarks/eval_masks.py", *argv])
    torch.set_num_threads(args.threads)
    lm = LeanKModel.from_pretrained(args.masks[0])
    methods, tags = [Full()], []
    for path in args.masks:
        mask = ChannelMask.from_pretrained(path)
        mask.validate(lm.model.config)
        tag = base = f"r{round(mask.ratio * 100)}"
        n = 1
        while tag in tags:  # two masks of one ratio (candidates side by side): r80, r80-2, ...
            n += 1
            tag = f"{base}-{n}"
        tags.append(tag)
        for i, rule in enumerate(args.rules):
            suffix = "" if i == 0 else f"-{rule}"
            methods.append(Learned(f"leank-{tag}{suffix}", mask, rule=rule))
            if not args.no_baselines:
                methods += [RandomChannels(f"random-{tag}{suffix}", like=mask, rule=rule),
                            ThinK(f"think-{tag}{suffix}", like=mask, rule=rule)]
            methods += [Learned(f"leank-{tag}{suffix}-{q}", mask, rule=rule, kv_quant=q) for q in args.kv_quants]
            methods += [RandomChannels(f"random-{tag}{suffix}-{q}", like=mask, rule=rule, kv_quant=q)
                        for q in args.random_kv_quants]
    for spec in args.hf_quants:
        backend, _, bits = spec.partition(":")
        if not bits.isdigit():
            p.error(f"--hf-quants {spec!r}: give BACKEND:BITS, e.g. quanto:4")
        methods.append(QuantizedKV(f"{backend}-int{bits}", backend, int(bits)))
    if args.from_json:
        res = json.loads(args.from_json.read_text())
        measured = p.parse_args(shlex.split(res["command"])[2:]).masks
        if measured != args.masks:
            sys.exit(f"{args.from_json} answered with the masks {measured}, not {args.masks}: "
                     f"give the masks of its command, in its order: {res['command']}")
        cmd, took = res["command"], res["seconds"]
        res = {**res, **renamed(res, {m: m for m in res["methods"]})}  # JSON's string keys summarized afresh
    else:
        start = time.perf_counter()
        res = evaluate(lm, args.lengths, args.samples, methods=methods, seed=args.seed, kl=False, tasks=args.tasks)
        took = time.perf_counter() - start
    probes = len(res["answers"])
    res["bytes_per_token"] = {m.name: method_bytes(m, lm, args.bytes_at) for m in methods}
    res["bytes_at"] = args.bytes_at
    print(f"`{cmd}`\n")
    print(format_table(res))
    print(f"\n{format_bytes(res)}")
    print(f"\n{probes} probes, {len(methods)} methods, {took / 60:.1f} min wall ({probes / took:.3f} probes/s), "
          f"{torch.get_num_threads()} torch threads")
    if args.json and not args.from_json:
        args.json.write_text(json.dumps({"command": cmd, "seconds": took, **res}, indent=1, default=str))
    quantised = bool(args.kv_quants or args.random_kv_quants or args.hf_quants)
    if args.plot:
        from leank_infer.hub.plots import plot_pareto

        plot_pareto(res, args.plot, cmd)
        print(f"plot: {args.plot}")
    if args.card and quantised:  # the cards keep their results; the run goes to their "KV quantisation" section
        for path, tag in zip(args.masks, tags, strict=True):
            write_model_card(path, None, figures={args.plot.name: cmd} if args.plot else None,
                             figure_files=[args.plot] if args.plot else (), kv_quant=kv_quant_record(res, tag, cmd))
            print(f"card: {path}")
    elif args.card:
        for path, tag in zip(args.masks, tags, strict=True):
            names = {"full": "full", f"leank-{tag}": "leank", f"random-{tag}": "random", f"think-{tag}": "think"}
            write_model_card(path, card_results(renamed(res, names), cmd))
            print(f"card: {path}")


def method_bytes(m, lm, tokens: int) -> float:
    """KV bytes per token of method ``m``'s cache after a prefill of ``tokens`` tokens, at bf16 (the deployment dtype;
    kv_quant's scales are float16 whatever the dtype), from the one formula (leank_infer.mask.kv_bytes)."""
    from leank_infer.decode.kv_quant import kv_quant_format
    from leank_infer.mask.kv_bytes import dense_token_bytes, hf_quantized_cache_bytes, prefilled_cache_bytes

    cfg = lm.model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if m.hf_quant is not None:
        return hf_quantized_cache_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, hd, tokens, m.hf_quant[1],
                                        torch.bfloat16) / tokens
    mask = getattr(m, "learned", None) or getattr(m, "like", None)
    if mask is None:
        return dense_token_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, hd, torch.bfloat16)
    return prefilled_cache_bytes(mask, tokens, torch.bfloat16, kv_quant_format(m.kv_quant)) / tokens


def kv_quant_record(res: dict, tag: str, cmd: str) -> dict:
    """The card's "KV quantisation" record of mask ``tag`` (leank_infer.hub.card.kv_quant_section): its methods
    and the mask-free ones (full model, QuantizedCache), each with its kv_quant, bytes and headline per length."""
    rows = []
    heads = res.get("headline", {})
    for name in res["methods"]:
        parts = name.split("-")
        if parts[0] in ("leank", "random", "think") and (len(parts) < 2 or parts[1] != tag):
            continue  # another mask's method
        quant = parts[-1] if parts[-1] in ("int8", "int4") and parts[0] in ("leank", "random") else "none"
        kind = {"leank": "LeanK", "random": "random channels", "think": "ThinK", "full": "full model"}.get(
            parts[0], f"QuantizedCache ({parts[0]}, {parts[-1]}, every channel)")
        if kind.startswith("QuantizedCache"):
            quant = parts[-1]
        rows.append({"method": kind, "name": name, "kv_quant": quant, "bytes_per_token": res["bytes_per_token"][name],
                     "headline": {str(n): f"{h['score']:.3f} +/- {h['se']:.3f}"
                                  for n in res["lengths"] if (h := heads.get(n, heads.get(str(n), {})).get(name))}})
    return {"command": cmd, "lengths": [int(n) for n in res["lengths"]], "bytes_at": res["bytes_at"], "rows": rows,
            "samples_per_task": res.get("samples_per_task"),
            "headline_tasks": {str(n): h["tasks"] for n in res["lengths"] if (h := heads.get(n, heads.get(str(n))))}}


def format_bytes(res: dict) -> str:
    """Markdown: each method's KV bytes per token next to its headline score at every length."""
    lengths = res["lengths"]
    heads = res.get("headline", {})
    at = lambda d, n: d.get(n, d.get(str(n), {}))  # noqa: E731 (int keys fresh, string keys from JSON)
    lines = [f"| method | KV bytes/token at {res['bytes_at']:,} (bf16) | " + " | ".join(f"headline {n}" for n in lengths)
             + " |", "|---|---|" + "---|" * len(lengths)]
    for name in res["methods"]:
        cells = []
        for n in lengths:
            h = at(heads, n).get(name)
            cells.append(f"{h['score']:.3f} +/- {h['se']:.3f}" if h else "n/a")
        lines.append(f"| {name} | {res['bytes_per_token'][name]:,.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
