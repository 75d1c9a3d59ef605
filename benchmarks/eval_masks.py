"""Several masks of one base model and the baselines at each one's budget, on the same suite probes, in one pass.

``leank eval MASK`` answers with the full model, one learned mask and the two baselines at its budget;
``leank eval A B`` sweeps masks without baselines. Here every probe is prefilled once (dense, shared) and
then decoded by the full model, each learned mask (``leank-r70``: the mask of ratio 0.7) and, per mask,
random and ThinK channels at its K budget (``random-r70``, ``think-r70``), so all of them are paired with
the full model on the same probes. Prints the suite table (``leank_train.evaluation.report``), and the
time taken. ``--card`` rewrites each mask's model card with its own rows (the full model, the mask as
``leank``, and the baselines at its budget as ``random`` and ``think``), this command next to them.
``--rules dense-prompt positional`` answers with each mask (and baseline) under each LeanK rule on the same
probes: the first rule's methods keep the names above, the others' get the rule as a suffix
(``leank-r70-positional``); the cards take the first rule's.
``--from-json F --card`` writes the cards from a run saved with ``--json F`` (the masks given must be among
the run's, in any order), next to the command that measured them, without answering again. Several saved runs (``--from-json F1K F4K F8K``, say
one per length, each with its own probes per task) give each card the rows of all of them, each row next to
the command that measured it; ``--card-add`` keeps the rows a card already holds from other commands (a run
added to a card, say a new length). ``--tasks`` takes variants of the suite's tasks too (``passkey:haystacks=filler``,
``niah_multikey:distractors=0``: ``leank_train.evaluation.tasks.task_variant``), answered and saved under their own
names (``passkey[haystacks=filler]``). ``--sweep-plot PNG`` draws the masks' headline scores and cache bytes against
their ratios at every length of the run(s) (with ``--card``, into each mask's card, this command under it).

KV quantisation (issue #33), on the same probes: ``--kv-quants int8 int4`` adds each mask with its middle quantised
(``leank-r70-int8``), ``--random-kv-quants int8`` random channels at its budget, quantised the same way
(``random-r70-int8``: the same bytes), ``--hf-quants quanto:4 quanto:2`` transformers' ``QuantizedCache`` alone
(``quanto-int4``: every channel, quantised). Every method's KV bytes per token after a prefill of ``--bytes-at``
tokens (bf16 model dtype) go into the JSON and the table; ``--plot F.png`` draws them against the headline score
(of the first run's first length). ``--from-json F1K F2K F4K --card`` with such runs gives each card's "KV
quantisation" section one table per run, under the command that measured it.

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
from leank_infer.decode.rule import DEFAULT_RULE, RETIRED_RULES, RuleError, check_rule, rules_help
from leank_infer.hub.card import read_eval_record, write_model_card
from leank_train.errors import RecipeError
from leank_train.evaluation.loop import evaluate
from leank_train.evaluation.methods import Full, Learned, QuantizedKV, RandomChannels, ThinK
from leank_train.evaluation.report import card_results, format_table, renamed
from leank_train.evaluation.settings import TASK_NAMES
from leank_train.evaluation.tasks import task_variant


def mask_tags(masks: list[ChannelMask]) -> list[str]:
    """Each mask's method suffix in a run: ``r70`` for ratio 0.7; two of one ratio ``r70``, ``r70-2``, ..."""
    tags: list[str] = []
    for mask in masks:
        tag = base = f"r{round(mask.ratio * 100)}"
        n = 1
        while tag in tags:
            n += 1
            tag = f"{base}-{n}"
        tags.append(tag)
    return tags


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("masks", nargs="+")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tasks", nargs="+", default=list(TASK_NAMES),
                   help="suite tasks, or variants of them: passkey:haystacks=filler, niah_multikey:distractors=0")
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rules", nargs="+", default=[DEFAULT_RULE],
                   help=f"LeanK rules to answer with, each mask and baseline once per rule: {rules_help()}")
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
    p.add_argument("--card-add", action="store_true",
                   help="with --card: keep the card's rows measured by other commands (a run's own rows are replaced)")
    p.add_argument("--from-json", type=Path, nargs="+", default=None,
                   help="no evaluation: the results of earlier runs' --json (each answered with every mask given)")
    p.add_argument("--sweep-plot", type=Path, default=None,
                   help="draw the masks' headline score and bytes against their ratio at each length (a .png)")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.card_add and not args.card:
        p.error("--card-add adds a run's rows to the cards: give --card too")
    if not args.from_json:  # a saved run's rules are history: read as stored
        try:
            [check_rule(rule) for rule in args.rules]
        except RuleError as e:
            p.error(f"--rules: {e}")
    cmd = shlex.join(["python", "benchmarks/eval_masks.py", *argv])
    torch.set_num_threads(args.threads)
    lm = LeanKModel.from_pretrained(args.masks[0])
    loaded = {path: ChannelMask.from_pretrained(path) for path in args.masks}
    for mask in loaded.values():
        mask.validate(lm.model.config)
    tags = mask_tags(list(loaded.values()))
    methods = [Full()]
    for path, tag in zip(args.masks, tags, strict=True):
        for i, rule in enumerate(args.rules):
            suffix = "" if i == 0 else f"-{rule}"
            methods.append(Learned(f"leank-{tag}{suffix}", loaded[path], rule=rule))
            if not args.no_baselines:
                methods += [RandomChannels(f"random-{tag}{suffix}", like=loaded[path], rule=rule),
                            ThinK(f"think-{tag}{suffix}", like=loaded[path], rule=rule)]
            methods += [Learned(f"leank-{tag}{suffix}-{q}", loaded[path], rule=rule, kv_quant=q)
                        for q in args.kv_quants]
            methods += [RandomChannels(f"random-{tag}{suffix}-{q}", like=loaded[path], rule=rule, kv_quant=q)
                        for q in args.random_kv_quants]
    for spec in args.hf_quants:
        backend, _, bits = spec.partition(":")
        if not bits.isdigit():
            p.error(f"--hf-quants {spec!r}: give BACKEND:BITS, e.g. quanto:4")
        methods.append(QuantizedKV(f"{backend}-int{bits}", backend, int(bits)))
    # per run: the run's own suffix of each mask given (a run may have answered with more masks, in any order)
    runs: list[dict] = []
    if args.from_json:
        for path in args.from_json:
            res = json.loads(path.read_text())
            ran = p.parse_args(shlex.split(res["command"])[2:])  # the saved run's own arguments
            # its rules as recorded; a run saved before runs recorded them decoded by the rule then the default
            ran.rules = res.get("rules") or [next(iter(RETIRED_RULES))]
            measured = ran.masks
            # a mask given is one the run answered with: the same folder, or a copy of its mask (a run on a
            # candidate's folder before it was copied into hub/)
            found = {m: next((x for x in measured if same_mask(m, x)), None) for m in args.masks}
            missing = [m for m, x in found.items() if x is None]
            if missing:
                sys.exit(f"{path} answered with the masks {measured}, not {missing}: "
                         f"give masks of its command: {res['command']}")
            theirs = dict(zip(measured, mask_tags([ChannelMask.from_pretrained(m) for m in measured]), strict=True))
            theirs = {m: theirs[found[m]] for m in args.masks}
            res = {**res, **renamed(res, {m: m for m in res["methods"]})}  # JSON's string keys summarized afresh
            runs.append({**res, "tags": [theirs[m] for m in args.masks], "ran": ran})
    else:
        try:
            tasks = [task_variant(t) for t in args.tasks]
        except RecipeError as e:
            sys.exit(str(e))
        start = time.perf_counter()
        res = evaluate(lm, args.lengths, args.samples, methods=methods, seed=args.seed, kl=False, tasks=tasks)
        res["bytes_per_token"] = {m.name: method_bytes(m, lm, args.bytes_at) for m in methods}
        res["bytes_at"] = args.bytes_at
        runs.append({"command": cmd, "rules": args.rules, "seconds": time.perf_counter() - start, **res})
        if args.json:
            args.json.write_text(json.dumps(runs[0], indent=1, default=str))
        runs[0]["tags"], runs[0]["ran"] = tags, args
    for res in runs:
        probes, took = len(res["answers"]), res["seconds"]
        print(f"`{res['command']}`\n")
        print(format_table(res))
        if res.get("bytes_per_token"):
            print(f"\n{format_bytes(res)}")
        print(f"\n{probes} probes, {len(res['methods'])} methods, {took / 60:.1f} min wall "
              f"({probes / took:.3f} probes/s), {res['ran'].threads} torch threads\n")
    quantised = bool(args.kv_quants or args.random_kv_quants or args.hf_quants) or any(
        name.rsplit("-", 1)[-1] in ("int8", "int4", "int2") for res in runs for name in res["methods"])
    if args.plot:
        from leank_infer.hub.plots import plot_pareto

        plot_pareto(runs[0], args.plot, runs[0]["command"])
        print(f"plot: {args.plot}")
    figures: dict[str, str] = {}
    if args.sweep_plot:
        from leank_infer.hub.plots import plot_ratio_sweep
        from leank_train.evaluation.report import format_sweep
        from leank_train.evaluation.sweep import merged_sweep

        sweep = merged_sweep(runs, list(loaded.items()), [[f"leank-{t}" for t in res["tags"]] for res in runs])
        print(format_sweep(sweep))
        plot_ratio_sweep(sweep, args.sweep_plot, cmd)
        figures[args.sweep_plot.name] = cmd
        print(f"figure: {args.sweep_plot}")
    if args.card and quantised:  # the cards keep their results; the runs go to their "KV quantisation" section
        for i, path in enumerate(args.masks):
            write_model_card(path, None, figures={args.plot.name: runs[0]["command"]} if args.plot else None,
                             figure_files=[args.plot] if args.plot else (),
                             kv_quant=[kv_quant_record(run, run["tags"][i], run["command"]) for run in runs])
            print(f"card: {path}")
    elif args.card:
        for i, path in enumerate(args.masks):
            rows = []
            for res in runs:
                tag = res["tags"][i]
                names = {"full": "full", f"leank-{tag}": "leank", f"random-{tag}": "random", f"think-{tag}": "think"}
                rule = res["ran"].rules[0]  # the rule of the rows the card takes
                for row in card_results(renamed(res, names), res["command"]):
                    if row.get("metric_config") in ("leank", "random", "think"):
                        row["metric_args"] = {**row.get("metric_args", {}), "rule": rule}
                    rows.append(row)
            if args.card_add:  # the card's rows of other commands stay, in front of this run's
                commands = {res["command"] for res in runs}
                rows = [r for r in read_eval_record(Path(path)).get("results", []) if r.get("command") not in commands] + rows
            write_model_card(path, rows, figures=figures or None,
                             figure_files=[args.sweep_plot] if args.sweep_plot else ())
            print(f"card: {path}")


def same_mask(a: str, b: str) -> bool:
    """Folders ``a`` and ``b`` hold the same mask: the same folder, or byte-identical mask.safetensors."""
    if Path(a).resolve() == Path(b).resolve():
        return True
    fa, fb = Path(a) / "mask.safetensors", Path(b) / "mask.safetensors"
    return fa.is_file() and fb.is_file() and fa.read_bytes() == fb.read_bytes()


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
