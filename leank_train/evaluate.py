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

import inspect
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

from leank_infer import ChannelMask
from leank_infer.cli_types import PositiveInt, UsageError, output_file, staged
from leank_infer.decode.rule import DEFAULT_RULE, check_rule
from leank_infer.folders.atomic import write_file
from leank_infer.hub.card import write_model_card

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
    "card_results", "eval_command", "evaluate", "format_sweep", "format_table", "make_probe", "next_token_kl",
    "random_mask_like", "ratio_sweep", "score_answer", "think_mask",
]

#: the method names ``--methods`` takes (:data:`leank_train.evaluation.methods.METHODS`)
METHODS = tuple(METHOD_CLASSES)


def eval_command(
    mask: list[str],
    *,
    revision: str | None = None,
    lengths: list[PositiveInt] = [1024, 2048],  # noqa: B006 (read only; shown in --help)
    samples: PositiveInt = 6,
    tasks: list[Literal[TASK_NAMES]] = list(TASK_NAMES),  # noqa: B006
    kinds: list[Literal[KINDS]] | None = None,
    quick: bool = False,
    methods: list[Literal[METHODS]] = list(METHODS),  # noqa: B006
    seed: int = 1234,
    kl: bool = True,
    rule: str = DEFAULT_RULE,
    kv_quant: Literal["int8", "int4"] | None = None,
    json: Path | None = None,
    plot: Path | None = None,
    card: bool = False,
) -> int:
    """Retrieval accuracy and next-token KL, full vs LeanK vs baselines (several masks: a ratio sweep).

    Lightning's progress bar counts the batches of probes (one per task and length) and shows the time left.

    Examples:
        leank eval hub/smollm2-135m-instruct-s3 --quick      # smoke test: about 4 min of one CPU core
        leank eval hub/smollm2-135m-instruct-s3 --lengths 1024 2048 --samples 25 --json runs/eval.json
        leank eval hub/smollm2-135m-instruct-s3 hub/smollm2-135m-instruct-r80-s3 --lengths 1024   # a ratio sweep

    Args:
        mask: mask repo folder or Hub id; several masks of one base model = a ratio sweep (LeanK only).
        revision: mask repo revision (Hub).
        lengths: lengths in tokens (the suite: prompt plus generation, as in RULER).
        samples: probes per task and length (with --kinds: per length, the kinds alternate).
        tasks: tasks of the suite (default: all ten, leank_train.evaluation.tasks).
        kinds: the older needle probes instead of the suite.
        quick: a smoke test: one length (1024), two probes per task, no KL (overrides --lengths, --samples,
            --kl); for SmolLM2-135M about 4 min of one CPU core (4 min 14 s CPU time: ``OMP_NUM_THREADS=1 leank eval
            hub/smollm2-135m-instruct-s3 --quick``), a larger model proportionally longer.
        methods: full model, the learned mask, a random mask, ThinK at the same K budget.
        seed: seed of the probes.
        kl: measure the next-token KL(full || LeanK) on held-out text (--no_kl skips it).
        rule: the LeanK rule, dense-prompt (the default): the prompt attends with every channel, each
            generated token by its position; or positional: every query, the prompt's too, by its position alone.
        kv_quant: the masks (and the baselines) decode with their middle quantised, int8 or int4 (KIVI's
            grouping, leank_infer.decode.kv_quant); the full model keeps its own cache. Default: the model's dtype.
        json: write results (with every answer) to this file.
        plot: draw the results to this PNG: accuracy vs length, or accuracy and bytes vs ratio for a sweep.
        card: rewrite the mask folder's model card with these results (and the plot, if drawn).
    """
    from leank_infer.cli import invocation

    try:
        check_rule(rule)
    except ValueError as e:
        raise UsageError(f"--rule: {e}") from None
    cmd = invocation("leank eval", eval_command, dict(locals()))
    args = SimpleNamespace(mask=mask, revision=revision, lengths=lengths, samples=samples, tasks=tasks,
                              kinds=kinds, quick=quick, methods=methods, seed=seed, no_kl=not kl, json=json,
                              plot=plot, card=card, rule=rule, kv_quant=kv_quant)
    return _eval(args, cmd)


def _eval(args: SimpleNamespace, cmd: str) -> int:
    if args.json:  # checked before the run: a bad path fails now, not after it; never inside a mask folder
        args.json = output_file(args.json, "--json")
    if args.card:  # a damaged eval.json would fail the card update after the whole run: now, not then
        from leank_infer.hub.card import read_eval_record

        for path in args.mask:
            if Path(path).is_dir():
                read_eval_record(path)
    if args.plot:  # inside a mask folder only when --card takes it in (drawn elsewhere, copied by the swap)
        args.plot = output_file(args.plot, "--plot", ".png", carded=args.mask if args.card else ())
    from .cli import quiet_lightning

    with staged(args.plot) as draw_to, quiet_lightning():
        return _evaluate(args, cmd, draw_to)


def _evaluate(args: SimpleNamespace, cmd: str, draw_to: Path | None) -> int:
    from leank_infer import LeanKModel
    from leank_infer.hub.plots import plot_accuracy, plot_ratio_sweep
    from leank_infer.mask import model_positions

    if args.quick:
        args.lengths, args.samples, args.no_kl = QUICK["lengths"], QUICK["samples"], not QUICK["kl"]
    tasks = None if args.kinds else args.tasks
    kinds = args.kinds or KINDS
    lm = LeanKModel.from_pretrained(args.mask[0], revision=args.revision, rule=args.rule, kv_quant=args.kv_quant)
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
                raise RecipeError(f"a sweep needs one base model, adapter and config overrides; "
                                 f"{path} is for {mask.base_model!r} "
                                 f"(adapter {mask.adapter!r}, overrides {mask.config_overrides}), {args.mask[0]} "
                                 f"for {lm.mask.base_model!r} (adapter {lm.mask.adapter!r}, "
                                 f"overrides {lm.mask.config_overrides})")
            mask.validate(lm.model.config)
            masks.append((path, mask))
        res = ratio_sweep(lm, masks, args.lengths, args.samples, kinds, args.seed, tasks=tasks)
        table = format_sweep(res)
        if args.plot:
            plot_ratio_sweep(res, draw_to, cmd)
    else:
        res = evaluate(lm, args.lengths, args.samples, kinds, args.methods, args.seed, kl=not args.no_kl, tasks=tasks)
        table = format_table(res)
        if args.plot:
            plot_accuracy(res, draw_to, cmd)
        if args.card:
            figures = {args.plot.name: cmd} if args.plot else None
            rows = card_results(res, cmd)
            for r in rows:  # the card says which quantisation the mask (and its baselines) decoded with
                if (r.get("metric_args") or {}).get("method", "full") != "full":
                    r["metric_args"]["kv_quant"] = args.kv_quant or "none"
            write_model_card(args.mask[0], rows, figures=figures, figure_files=[draw_to] if args.plot else ())
    if args.card and len(args.mask) > 1:
        from leank_infer.hub.card import read_eval_record

        for path, row in zip(args.mask, res["masks"], strict=True):
            figures = {args.plot.name: cmd} if args.plot else {}
            # a card keeps the rows it has (e.g. a single-mask eval with baselines); one without gets the sweep's
            rows = None
            if "results" not in read_eval_record(path):
                rows = card_results({"accuracy": {"full": res["full"], "leank": row["accuracy"]}}, cmd)
                if "tasks" in row:
                    rows = card_results({**row, "methods": ["full", "leank"]}, cmd)
            write_model_card(path, rows, figures=figures, figure_files=[draw_to] if args.plot else ())
    print(f"\n`{cmd}`\n")
    print(table)
    if args.json:
        write_file(args.json, json.dumps({"command": cmd, "rule": args.rule, "kv_quant": args.kv_quant, **res}, indent=2))
    return 0
