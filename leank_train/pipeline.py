"""``leank run RECIPE.yaml [--key value ...]``: stage 1, stage 2 and the export of a recipe, in one go.

Each stage is the LightningCLI run ``fit --config RECIPE --stage N`` (see :mod:`leank_train.cli`).
Overrides ``--key value`` go to both stages; ``--stage1.key value`` / ``--stage2.key value`` to one.
Stage 2 starts from the mask folder stage 1 exported (``--model.init_scores`` is set to it), and
stage 2's export is the recipe's output mask repo.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from leank_infer.mask import ChannelMask

from .cli import run_cli
from .evaluate import EvalSettings, card_results, evaluate, format_table
from .export import ExportMask


def split_overrides(args: Sequence[str]) -> dict[int, list[str]]:
    """Route ``--key value`` pairs: plain ones to both stages, ``--stageN.key`` ones to stage N only."""
    routed: dict[int, list[str]] = {1: [], 2: []}
    items = list(args)
    i = 0
    while i < len(items):
        flag = items[i]
        if not flag.startswith("--"):
            raise SystemExit(f"leank run: expected --key value, got {flag!r}")
        pair = [flag] if "=" in flag else items[i : i + 2]
        i += len(pair)
        for stage in (1, 2):
            prefix = f"--stage{stage}."
            if flag.startswith(prefix):
                routed[stage] += ["--" + pair[0][len(prefix) :], *pair[1:]]
                break
        else:
            routed[1] += pair
            routed[2] += pair
    return routed


def _export_dir(cli) -> str:
    """The mask folder the stage exported. Distributed, rank 0 writes it and the others wait for it."""
    cli.trainer.strategy.barrier("leank-export")
    for cb in cli.trainer.callbacks:
        if isinstance(cb, ExportMask) and cb.dirpath is not None and (
            cb.exported is not None or not cli.trainer.is_global_zero
        ):
            return str(cb.exported or cb.dirpath)
    raise SystemExit("the stage wrote no mask folder: set export.dirpath in the recipe")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run a recipe end to end and print wall time, final distillation loss and what the mask keeps."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    recipe, overrides = args[0], split_overrides(args[1:])
    start = time.perf_counter()

    stage1 = run_cli(["fit", "--config", recipe, "--stage", "1", *overrides[1]])
    stage1_dir = _export_dir(stage1)
    t1 = time.perf_counter() - start
    loss1 = stage1.model.final_distill_loss
    print(f"[leank run] stage 1 done in {t1:.0f} s, mask scores in {stage1_dir}", flush=True)

    stage2 = run_cli(["fit", "--config", recipe, "--stage", "2", *overrides[2], "--model.init_scores", stage1_dir])
    out_dir = _export_dir(stage2)
    if not stage2.trainer.is_global_zero:
        return 0  # multi-GPU: rank 0 reports, evaluates and pushes
    wall = time.perf_counter() - start
    loss2 = stage2.model.final_distill_loss
    stats = ChannelMask.from_dir(out_dir).stats()
    print(
        "[leank run] done\n"
        f"  wall time          {wall:.0f} s (stage 1 {t1:.0f} s, stage 2 {wall - t1:.0f} s)\n"
        f"  final distill loss stage 1 {_fmt(loss1)}, stage 2 {_fmt(loss2)} (mean of the last 10 steps)\n"
        f"  k_kept_fraction    {stats['k_kept_fraction']:.3f}\n"
        f"  v_kept_fraction    {stats['v_kept_fraction']:.3f}\n"
        f"  zero heads         {stats['zero_heads']} of {stats['total_heads']}\n"
        f"  mask repo          {out_dir}",
        flush=True,
    )
    cfg = stage2.config["fit"] if "fit" in stage2.config else stage2.config
    settings = EvalSettings(**vars(cfg.evaluate))
    if settings.enabled:
        _evaluate_into_card(out_dir, settings)
    if cfg.push_to_hub:
        info = ChannelMask.from_dir(out_dir).push_to_hub(cfg.push_to_hub, folder=out_dir)
        print(f"[leank run] pushed to {info}", flush=True)
    return 0


def _evaluate_into_card(out_dir: str, settings: EvalSettings) -> None:
    """``leank eval`` on the exported mask; its table goes into the model card, with the command."""
    from leank_infer import LeanKModel
    from leank_infer.card import write_model_card

    start = time.perf_counter()
    lm = LeanKModel.from_pretrained(out_dir)
    res = evaluate(lm, settings.lengths, settings.samples, methods=settings.methods, seed=settings.seed,
                   kl=settings.kl)
    command = settings.command(out_dir)
    write_model_card(out_dir, card_results(res, command))
    print(f"[leank run] evaluation ({time.perf_counter() - start:.0f} s): `{command}`\n{format_table(res)}",
          flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
