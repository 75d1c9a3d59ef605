"""``leank run RECIPE.yaml [--key value ...]``: stage 1, stage 2 and the export of a recipe, in one go.

A recipe is flat and typed (:class:`leank_train.recipe.Recipe`); every key can be given on the command
line (``--stage2.steps 80``, ``--trainer.devices 8``, ``--mask_dir hub/...``). Each stage is the
LightningCLI ``fit`` run of the config :func:`~leank_train.recipe.stage_config` derives for it; stage 2
starts from the scores stage 1 exported. A recipe's ``compare_to`` (a committed mask folder) is read
before training and, at the end, set beside the new mask (:mod:`leank_train.compare`).

Rerunning the same command after an interruption (kill -9, power loss) loses nothing: each stage
checkpoints to ``<out_dir>/checkpoints/stageN/<fingerprint>/last.ckpt`` (Lightning's ``ModelCheckpoint``)
and runs with ``--ckpt_path last``, so an unfinished stage resumes from its last checkpoint; a stage whose
mask folder was exported by a run of the same settings (a ``finished.json`` next to its checkpoints, and
the folder loads) is skipped. The fingerprint hashes the resolved stage config (minus logging and
evaluation settings) and, for stage 2, the stage-1 scores it starts from: changed settings never resume
from a stale checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from pickle import UnpicklingError  # the exception only: Lightning reads checkpoints weights-only
from typing import Any, Literal

import yaml
from lightning.pytorch.utilities import rank_zero_only

from leank_infer.folders.atomic import write_file
from leank_infer.hub.publish import push_folder
from leank_infer.mask import MASK_FILE, ChannelMask, MaskError, check_mask_target

from .cli import quiet_lightning, run_cli
from .compare import MaskSnapshot, format_comparison, read_reference
from .errors import RecipeError
from .evaluate import EvalSettings, card_results, evaluate, format_table
from .export import ExportMask
from .recipe import Recipe, stage_config
from .recipe_checks import check_recipe

# settings that change neither the data, the steps nor the learned alpha: leaving them out of the
# fingerprint lets a rerun with another logger, progress bar, evaluation or output folder still resume
# (a new export.dirpath resumes from the final checkpoint and exports there)
COSMETIC = {
    "config", "ckpt_path", "checkpoint", "evaluate", "push_to_hub", "compare_to", "stage1", "stage2",
    "trainer.logger", "trainer.enable_progress_bar", "trainer.enable_model_summary",
    "trainer.log_every_n_steps", "trainer.default_root_dir", "export.dirpath", "export.recipe", "data.num_workers",
}
FINISHED = "finished.json"


def _export_dir(cli) -> str:
    """The mask folder the stage exported. Distributed, rank 0 writes it and the others wait for it."""
    cli.trainer.strategy.barrier("leank-export")
    for cb in cli.trainer.callbacks:
        if isinstance(cb, ExportMask) and cb.dirpath is not None and (
            cb.exported is not None or not cli.trainer.is_global_zero
        ):
            return str(cb.exported or cb.dirpath)
    raise RecipeError("the stage wrote no mask folder")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _drop(tree: dict[str, Any], dotted: str) -> None:
    head, _, rest = dotted.partition(".")
    if rest and isinstance(tree.get(head), dict):
        _drop(tree[head], rest)
    elif not rest:
        tree.pop(head, None)


def stage_fingerprint(config: dict[str, Any], init_scores: str | None = None) -> str:
    """Hash of what determines a stage's result: its resolved config and the scores it starts from."""
    tree = json.loads(json.dumps(config, default=str))
    for key in COSMETIC:
        _drop(tree, key)
    digest = hashlib.sha256(json.dumps(tree, sort_keys=True).encode())
    if init_scores is not None:
        path = Path(init_scores)
        path = path / MASK_FILE if path.is_dir() else path
        digest.update(path.read_bytes() if path.is_file() else b"missing")
    return digest.hexdigest()[:16]


def _complete(folder: str | None) -> bool:
    if not folder:
        return False
    try:
        ChannelMask.from_dir(folder)
    except MaskError:
        return False
    return True


def run_stage(
    recipe: Recipe, stage: Literal[1, 2], before: Callable[[dict[str, Any]], None] | None = None
) -> tuple[str, dict[str, Any]]:
    """Run (or resume, or skip) one stage of a recipe; returns (its export folder, its resolved config).

    ``before`` sees the resolved config before anything trains or is written.
    """
    args = ["--config", yaml.safe_dump(stage_config(recipe, stage, recipe_text(recipe)), sort_keys=False)]
    probe = run_cli(args, run=False)  # parse + instantiate (nothing is loaded or written): the resolved config
    cfg = yaml.safe_load(probe.parser.dump(probe.config, skip_none=False))
    if before is not None:
        before(cfg)
    export_dir = cfg["export"]["dirpath"]
    fingerprint = stage_fingerprint(cfg, (cfg.get("model") or {}).get("init_scores") if stage == 2 else None)
    root = (cfg.get("checkpoint") or {}).get("dirpath") or os.path.join(
        (cfg.get("trainer") or {}).get("default_root_dir") or ".", "checkpoints", f"stage{stage}"
    )
    ckpt_dir = Path(root) / fingerprint
    finished = ckpt_dir / FINISHED
    if finished.is_file() and json.loads(finished.read_text()).get("export") == export_dir and _complete(export_dir):
        print(f"[leank run] stage {stage} already done with these settings: {export_dir} (skipped)", flush=True)
        return export_dir, cfg
    last = sorted(ckpt_dir.glob("last*.ckpt"))
    if last:
        damage = checkpoint_damage(last[-1])
        if damage:
            raise RecipeError(f"checkpoint {last[-1]} is damaged ({damage}); delete it to run stage {stage} afresh "
                              "(or from an earlier checkpoint)")
        print(f"[leank run] stage {stage} resumes from {last[-1]}", flush=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*there is no last checkpoint available")
        try:
            cli = run_cli(["fit", *args, "--checkpoint.dirpath", str(ckpt_dir), "--ckpt_path", "last"])
        except UnpicklingError as e:  # torch refused it (weights-only loading): never unpickle more
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RecipeError(
                f"checkpoint {last[-1] if last else ckpt_dir} holds more than tensors and plain data, so it was not "
                f"loaded ({first}); delete it to run stage {stage} afresh"
            ) from None
    out = _export_dir(cli)
    if cli.trainer.is_global_zero:
        _write_json(finished, {"export": export_dir, "fingerprint": fingerprint,
                               "steps": int(cli.trainer.global_step)})
    return out, cfg


def checkpoint_damage(path: Path) -> str | None:
    """Why the checkpoint ``path`` cannot be resumed from, checked without loading it (None when it looks whole):
    torch.save writes a zip archive, and a run killed while writing leaves one cut short, which torch's
    reader only reports as a raw error on every rerun. Nothing is unpickled here."""
    import zipfile

    try:
        with open(path, "rb") as f:
            head = f.read(4)
            if len(head) < 4:
                return f"{len(head)} bytes: a run killed as it began writing it"
            if head != b"PK\x03\x04":
                return None  # not a zip: torch's weights-only loader decides (and refuses more than tensors)
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"not a whole zip archive: {e}"
    return f"entry {bad} fails its CRC check" if bad else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_file(path, json.dumps(data))


def _training_loss(folder: str) -> float | None:
    return (ChannelMask.from_dir(folder).extra.get("training") or {}).get("final_distill_loss_last10")


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """The recipe file ``path`` with command-line style ``overrides`` (``--stage2.steps 80``), as ``leank run`` reads it."""
    from leank_infer.cli import parse

    return parse(run, [str(path), *overrides], "leank run")["recipe"]


def recipe_text(recipe: Recipe) -> str:
    """The resolved recipe as YAML: stored in the mask's config.json, it reruns as ``leank run FILE``."""
    return yaml.safe_dump(asdict(recipe), sort_keys=False)


def run(recipe: Recipe, *, stage: Literal[1, 2] | None = None, quick: bool = False, dump: bool = False) -> int:
    """Train a recipe: stage 1, stage 2, export, evaluation into the model card (resumes when rerun).

    Lightning's progress bar shows each stage's steps, its speed and the time left.

    Examples:
        leank run recipes/smollm2-135m.yaml                    # both stages, export, evaluation
        leank run recipes/smollm2-135m.yaml --out_dir runs/mine --stage2.steps 80
        leank run recipes/smollm2-135m.yaml --evaluate.lengths 1024 2048 --quick
        leank run recipes/smollm2-135m.yaml --stage 1 --dump   # print stage 1's LightningCLI config, run nothing

    Args:
        recipe: the recipe file, e.g. recipes/smollm2-135m.yaml.
        stage: run only this stage (stage 2 starts from the scores in stage1_dir).
        quick: evaluate in the smoke-test mode of ``leank eval --quick``.
        dump: print the stages' LightningCLI fit configs (what ``leank fit --config`` takes) and stop.
    """
    if quick:
        recipe.evaluate.quick = True
    stages: tuple[Literal[1, 2], ...] = (1, 2) if stage is None else (stage,)
    if dump:
        for s in stages:
            print(yaml.safe_dump(stage_config(recipe, s), sort_keys=False), end="")
        return 0
    return _run(recipe, stages)


def _run(recipe: Recipe, stages: tuple[int, ...] = (1, 2)) -> int:
    # every value, and both export folders, refused before anything loads or trains (not after a stage trained)
    check_recipe(recipe)
    for folder in [recipe.scores_dir] * (1 in stages) + [recipe.output_dir] * (2 in stages):
        check_mask_target(folder)
    start = time.perf_counter()
    references: dict[str, MaskSnapshot] = {}

    def read_compare_to(cfg: dict[str, Any]) -> None:
        # read now: the stage-2 export may replace this very folder (reproducing the committed mask)
        folder = recipe.compare_to
        if folder and folder not in references:
            references[folder] = read_reference(folder)

    loss1, t1 = None, 0.0
    if 1 in stages:
        stage1_dir, _ = run_stage(recipe, 1, before=read_compare_to if stages == (1, 2) else None)
        t1 = time.perf_counter() - start
        loss1 = _training_loss(stage1_dir)
        print(f"[leank run] stage 1 done in {t1:.0f} s, mask scores in {stage1_dir}", flush=True)
        if 2 not in stages:
            return 0
    out_dir, cfg = run_stage(recipe, 2, before=read_compare_to)
    if rank_zero_only.rank != 0:
        return 0  # multi-GPU: rank 0 reports, evaluates and pushes
    wall = time.perf_counter() - start
    loss2 = _training_loss(out_dir)
    stats = ChannelMask.from_dir(out_dir).stats()
    print(
        "[leank run] done\n"
        f"  wall time          {wall:.0f} s (stage 1 {t1:.0f} s, stage 2 {wall - t1:.0f} s)\n"
        f"  final distill loss stage 1 {_fmt(loss1)}, stage 2 {_fmt(loss2)} (mean of the last 10 steps)\n"
        f"  k_kept_fraction    {stats['k_kept_fraction']:.3f}\n"
        f"  v_kept_fraction    {stats['v_kept_fraction']:.3f}\n"
        f"  zero heads         {stats['zero_heads']} of {stats['total_heads']}\n"
        f"  mask repo          {out_dir}"
        + ("" if recipe.push_to_hub else f"\n  publish it with    leank push {out_dir} ORG/NAME"),
        flush=True,
    )
    if recipe.evaluate.enabled:
        _evaluate_into_card(out_dir, recipe.evaluate)
    if recipe.push_to_hub:
        info = push_folder(out_dir, recipe.push_to_hub)
        print(f"[leank run] pushed to {info}", flush=True)
    if recipe.compare_to:
        print(format_comparison(MaskSnapshot.read(out_dir), references[recipe.compare_to]), flush=True)
    return 0


def _evaluate_into_card(out_dir: str, settings: EvalSettings) -> None:
    """``leank eval`` on the exported mask; its table goes into the model card, with the command."""
    from leank_infer import LeanKModel
    from leank_infer.hub.card import write_model_card

    start = time.perf_counter()
    lm = LeanKModel.from_pretrained(out_dir)
    run = settings.resolved()
    with quiet_lightning():
        res = evaluate(lm, run.lengths, run.samples, methods=run.methods, seed=run.seed, kl=run.kl, tasks=run.tasks)
    command = settings.command(out_dir)
    write_model_card(out_dir, card_results(res, command))
    print(f"[leank run] evaluation ({time.perf_counter() - start:.0f} s): `{command}`\n{format_table(res)}",
          flush=True)


if __name__ == "__main__":
    from leank_infer.cli import main

    raise SystemExit(main(["run", *sys.argv[1:]]))
