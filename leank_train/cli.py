"""``leank fit ...``: one training stage as a plain LightningCLI.

``leank run`` derives each stage's ``fit`` config from a flat recipe (:mod:`leank_train.recipe`) and runs
it here; ``leank run RECIPE --stage 1 --dump`` prints that config, which ``leank fit --config`` takes::

    leank run recipes/smollm2-135m.yaml --stage 1 --dump > stage1.yaml
    leank fit --config stage1.yaml --trainer.max_steps 20
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from .data import NeedleDataModule
from .distill.module import LeanKDistillation
from .errors import RecipeError
from .export import ExportMask

SUBCOMMANDS = ("fit", "validate", "test", "predict")
#: where Lightning logs its info lines (rank zero's, one name per package that re-binds it; the seed's)
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                     "lightning_utilities.core.rank_zero", "lightning.fabric.utilities.seed")
#: a deprecation torch raises inside Lightning's own code (its LeafSpec use): nothing a leank user can act on
LIGHTNING_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


class _Banners(logging.Filter):
    """Drops Lightning's advertising ("💡 Tip: ... litlogger / litmodels") and, unless kept, its set-up lines (the
    devices, the seed): a stage that trains says them once; a probe that only builds the trainer, or an evaluation,
    says none."""

    DEVICE = ("GPU available", "TPU available", "HPU available", "IPU available", "LOCAL_RANK", "Seed set to")

    def __init__(self, device_info: bool) -> None:
        super().__init__()
        self.device_info = device_info

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.getMessage())
        return not (text.startswith("💡") or (not self.device_info and text.startswith(self.DEVICE)))


@contextmanager
def quiet_lightning(device_info: bool = False) -> Iterator[None]:
    """Lightning inside a leank command without third-party banners: its tips, torch's deprecation warning from
    Lightning's code and, unless ``device_info`` (training: which accelerator runs it), its device lines. Only
    these messages, only while the command runs: the filters come off after it (other warnings still show)."""
    banners = _Banners(device_info)
    loggers = [logging.getLogger(name) for name in RANK_ZERO_LOGGERS]
    for log in loggers:
        log.addFilter(banners)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=LIGHTNING_DEPRECATION, category=FutureWarning)
            yield
    finally:
        for log in loggers:
            log.removeFilter(banners)


class LeanKCLI(LightningCLI):
    """LightningCLI with the mask export and checkpoint callbacks and the model -> data links.

    ``checkpoint`` is Lightning's ``ModelCheckpoint`` (alpha + optimizer state, under 1 MB), by default
    ``last.ckpt`` every 10 steps: with a fixed ``dirpath``, ``--ckpt_path last`` resumes a stage.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ExportMask, "export")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        # resumable by default, also for recipes without a `checkpoint:` section: last.ckpt every 10 steps
        parser.set_defaults({"checkpoint.every_n_train_steps": 10, "checkpoint.save_last": True,
                             "checkpoint.save_top_k": 0})
        # the data needs the model's tokenizer: say the base model once
        parser.link_arguments("model.base_model", "data.base_model")
        parser.link_arguments("model.revision", "data.revision")
        parser.link_arguments("model.loader", "data.loader")

    def before_instantiate_classes(self) -> None:
        # Store the recipe's text in the exported config.json unless one was named explicitly.
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        if cfg.get("export") is not None and cfg.export.get("recipe") is None:
            for path in cfg.get("config") or []:
                if path is not None and Path(str(path)).is_file():
                    cfg.export.recipe = str(path)
                    break


def run_cli(argv: Sequence[str] | None = None, **kwargs: Any) -> LeanKCLI:
    """Build (and by default run) the CLI for ``argv``; returns the LightningCLI with its trainer and model."""
    args = list(argv) if argv is not None else None
    from argparse import ArgumentError

    from leank_infer.cli import one_line

    # argv is given explicitly (leank's own entry point); Lightning warns when sys.argv also has words.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    # no third-party banners; the device lines only when a stage runs (not for a probe that only builds it)
    quiet = quiet_lightning(device_info=kwargs.get("run", True))
    try:
        with quiet:
            return LeanKCLI(
                LeanKDistillation,
                NeedleDataModule,
                args=args,
                auto_configure_optimizers=False,
                save_config_kwargs={"overwrite": True},
                parser_kwargs={"exit_on_error": False, "prog": "leank"},
                **kwargs,
            )
    except ArgumentError as e:  # a bad key or value: one line (the entry point prints it, exit code 2)
        raise RecipeError(one_line(e.message)) from None


def fit(argv: Sequence[str]) -> int:
    """Entry of ``leank fit``: a LightningCLI command line; ``fit`` is implied when no subcommand leads."""
    from leank_infer.cli import check_argv_text, check_config_args

    args = list(argv)
    if not args or args[0] not in SUBCOMMANDS:
        args = ["fit", *args]
    check_argv_text(args)  # a byte that is not UTF-8 in a value: one line naming its option, not a traceback
    check_config_args(args)  # a FIFO, an alias bomb or /etc/shadow as --config: one line, before jsonargparse reads it
    run_cli(args)
    return 0


if __name__ == "__main__":
    from leank_infer.cli import main

    sys.exit(main(["fit", *sys.argv[1:]]))
