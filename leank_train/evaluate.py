"""``leank eval``: long-context accuracy and next-token KL, full model vs LeanK vs baselines at equal K budget.

The command line of :mod:`leank_train.evaluation`, which holds the pieces: the RULER-style suite
(``tasks``; ten tasks, reported per task, with Wilson intervals, paired counts against the full model and a
headline over the tasks the full model passes: ``stats``), the older needle kinds (``needles``, with
``--kinds``), the methods (``methods``: full, learned, random and ThinK channels at the learned K budget),
the loop (``loop``: one shared dense prefill per batch of probes), the KL (``kl``) and the tables and card
rows (``report``). Neither probe set shares wordings, haystack sentences or key words with the training
data (``leank_train.data``). The names below are re-exported for the callers of this module.
"""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Sequence
from pathlib import Path

from leank_infer import ChannelMask
from leank_infer.card import write_model_card
from leank_infer.cli_types import positive_int

from .errors import RecipeError
from .evaluation.kl import next_token_kl
from .evaluation.loop import RetrievalEval, answer_with, evaluate, ratio_sweep, score_answer
from .evaluation.methods import METHODS as METHOD_CLASSES
from .evaluation.methods import Method, random_mask_like, think_mask
from .evaluation.needles import KINDS, make_probe
from .evaluation.report import card_results, format_sweep, format_table
from .evaluation.settings import QUICK, TASK_NAMES, EvalSettings

__all__ = [
    "KINDS", "METHODS", "QUICK", "TASK_NAMES", "EvalSettings", "Method", "RetrievalEval", "answer_with",
    "card_results", "evaluate", "format_sweep", "format_table", "main", "make_probe", "next_token_kl",
    "random_mask_like", "ratio_sweep", "score_answer", "think_mask",
]

#: the method names ``--methods`` takes (:data:`leank_train.evaluation.methods.METHODS`)
METHODS = tuple(METHOD_CLASSES)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="leank eval", description="Retrieval accuracy full vs LeanK vs baselines.")
    p.add_argument("mask", nargs="+",
                   help="mask repo folder or Hub id; several masks of one base model = a ratio sweep (LeanK only)")
    p.add_argument("--revision", default=None)
    p.add_argument("--lengths", type=positive_int, nargs="+", default=[1024, 2048])
    p.add_argument("--samples", type=positive_int, default=6,
                   help="probes per task and length (with --kinds: per length, the kinds alternate)")
    p.add_argument("--tasks", nargs="+", default=list(TASK_NAMES), choices=TASK_NAMES, metavar="TASK",
                   help=f"tasks of the suite (default: all of {', '.join(TASK_NAMES)})")
    p.add_argument("--kinds", nargs="+", default=None, choices=KINDS,
                   help="the older needle probes instead of the suite")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke test: {QUICK['lengths']} tokens, {QUICK['samples']} probes per task, no KL "
                        "(overrides --lengths, --samples and the KL)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-kl", action="store_true", help="skip the next-token KL measurement")
    p.add_argument("--json", type=Path, default=None, help="write results (with every answer) to this file")
    p.add_argument("--plot", type=Path, default=None,
                   help="draw the results to this PNG: accuracy vs length, or accuracy and bytes vs ratio for a sweep")
    p.add_argument("--card", action="store_true",
                   help="rewrite the mask folder's model card with these results (and the plot, if drawn)")
    args = p.parse_args(argv)
    from .cli import one_line_errors

    with one_line_errors("leank eval"):
        return _main(args, argv)


def _main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from leank_infer import LeanKModel
    from leank_infer.mask import model_positions
    from leank_infer.plots import plot_accuracy, plot_ratio_sweep

    cmd = "leank eval " + " ".join(argv)
    if args.quick:
        args.lengths, args.samples, args.no_kl = QUICK["lengths"], QUICK["samples"], not QUICK["kl"]
    tasks = None if args.kinds else args.tasks
    kinds = args.kinds or KINDS
    lm = LeanKModel.from_pretrained(args.mask[0], revision=args.revision)
    limit = model_positions(lm.model.config)
    # a suite length is the whole budget (prompt + generation, as in RULER); a needle length the prompt's
    new = 0 if tasks is not None else inspect.signature(evaluate).parameters["max_new_tokens"].default
    if limit is not None and max(args.lengths) + new > limit:
        raise RecipeError(f"--lengths {max(args.lengths):,}{f' + {new} new tokens' if new else ''} exceeds the "
                          f"model's {limit:,} positions (max_position_embeddings); use lengths up to {limit - new:,}")
    if len(args.mask) > 1:
        masks = [(args.mask[0], lm.mask)]
        for path in args.mask[1:]:
            mask = ChannelMask.from_pretrained(path, revision=args.revision)
            model_of = lambda m: (m.base_model, m.adapter, m.adapter_revision, m.config_overrides)  # noqa: E731
            if model_of(mask) != model_of(lm.mask):
                raise SystemExit(f"leank eval: a sweep needs one base model, adapter and config overrides; "
                                 f"{path} is for {mask.base_model!r} "
                                 f"(adapter {mask.adapter!r}, overrides {mask.config_overrides}), {args.mask[0]} "
                                 f"for {lm.mask.base_model!r} (adapter {lm.mask.adapter!r}, "
                                 f"overrides {lm.mask.config_overrides})")
            mask.validate(lm.model.config)
            masks.append((path, mask))
        res = ratio_sweep(lm, masks, args.lengths, args.samples, kinds, args.seed, tasks=tasks)
        table = format_sweep(res)
        if args.plot:
            plot_ratio_sweep(res, args.plot, cmd)
    else:
        res = evaluate(lm, args.lengths, args.samples, kinds, args.methods, args.seed, kl=not args.no_kl, tasks=tasks)
        table = format_table(res)
        if args.plot:
            plot_accuracy(res, args.plot, cmd)
        if args.card:
            figures = {args.plot.name: cmd} if args.plot else None
            write_model_card(args.mask[0], card_results(res, cmd), figures=figures)
    if args.card and len(args.mask) > 1:
        from leank_infer.card import EVAL_FILE

        for path, row in zip(args.mask, res["masks"], strict=True):
            figures = {args.plot.name: cmd} if args.plot else {}
            # a card keeps the rows it has (e.g. a single-mask eval with baselines); one without gets the sweep's
            rows = None
            if not (Path(path) / EVAL_FILE).is_file() or "results" not in json.loads((Path(path) / EVAL_FILE).read_text()):
                rows = card_results({"accuracy": {"full": res["full"], "leank": row["accuracy"]}}, cmd)
                if "tasks" in row:
                    rows = card_results({**row, "methods": ["full", "leank"]}, cmd)
            write_model_card(path, rows, figures=figures)
    if args.card and args.plot:
        import shutil

        for path in args.mask:
            target = Path(path) / args.plot.name
            if Path(path).is_dir() and target.resolve() != args.plot.resolve():
                shutil.copyfile(args.plot, target)
    print(f"\n`{cmd}`\n")
    print(table)
    if args.json:
        args.json.write_text(json.dumps({"command": cmd, **res}, indent=2))
    return 0
