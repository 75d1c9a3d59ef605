"""``leank fit ...``: one training stage as a plain LightningCLI.

A recipe is one YAML for both stages: the top level is an ordinary LightningCLI config (``trainer``,
``model``, ``data``, ``export``: what the stages share), and the sections ``stage1:`` / ``stage2:``
hold each stage's overrides in the same shape. ``--stage N`` stands for ``--config <section stageN
of the configs given before it>``, so precedence is the usual jsonargparse one: recipe, then
stage section, then later flags::

    leank fit --config recipes/smollm2-135m.yaml --stage 1 --trainer.max_steps 20
    leank fit --config recipes/smollm2-135m.yaml --stage 2 --model.init_scores runs/.../stage1

Without ``--stage`` the top level runs as is (the recipes make it stage 1). ``leank run`` chains both.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from pickle import UnpicklingError  # the exception only: Lightning reads checkpoints weights-only
from typing import Any

import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from leank_infer.mask import MaskError
from leank_infer.model.loading import BaseModelError

from .data import NeedleDataModule
from .distill.finite import NonFiniteError
from .distill.module import LeanKDistillation
from .errors import RecipeError
from .evaluate import EvalSettings
from .export import ExportMask

SUBCOMMANDS = ("fit", "validate", "test", "predict")


class LeanKCLI(LightningCLI):
    """LightningCLI with the mask export and checkpoint callbacks, the stage sections, and model -> data links.

    ``checkpoint`` is Lightning's ``ModelCheckpoint`` (alpha + optimizer state, under 1 MB), by default
    ``last.ckpt`` every 10 steps: with a fixed ``dirpath``, ``--ckpt_path last`` resumes a stage.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ExportMask, "export")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        # resumable by default, also for recipes without a `checkpoint:` section: last.ckpt every 10 steps
        parser.set_defaults({"checkpoint.every_n_train_steps": 10, "checkpoint.save_last": True,
                             "checkpoint.save_top_k": 0})
        parser.add_argument("--stage1", type=dict | None, default=None, help="stage-1 overrides (see --stage)")
        parser.add_argument("--stage2", type=dict | None, default=None, help="stage-2 overrides (see --stage)")
        # used by `leank run` after stage 2 (a plain `fit` ignores them)
        parser.add_class_arguments(EvalSettings, "evaluate")
        parser.add_argument("--push_to_hub", type=str | None, default=None, help="Hub repo id to push the mask to")
        parser.add_argument("--compare_to", type=str | None, default=None,
                            help="a committed mask folder `leank run` compares its result with at the end")
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


MAX_RECIPE_BYTES = 1 << 20


def read_recipe(path: str | Path) -> dict[str, Any]:
    """A recipe file's YAML mapping; a missing, binary, huge or non-mapping file is one RecipeError naming it."""
    path = Path(path)
    if not path.exists():
        raise RecipeError(f"recipe {str(path)!r}: no such file")
    if not path.is_file():
        raise RecipeError(f"recipe {str(path)!r} is not a regular file")
    if path.stat().st_size > MAX_RECIPE_BYTES:
        raise RecipeError(f"recipe {path} is {path.stat().st_size:,} bytes; a recipe is a YAML file of at most 1 MiB")
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise RecipeError(f"recipe {path} is not UTF-8 text (a binary file?); give a YAML recipe") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe {path} is not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise RecipeError(f"recipe {path} nests too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(
            f"recipe {path} holds a YAML {type(data).__name__}; a recipe is a mapping (trainer:, model:, stage1:, ...)"
        )
    return data


def expand_stage(argv: Sequence[str]) -> list[str]:
    """Replace ``--stage N`` by ``--config <the stageN section of the earlier --config files>``."""
    out: list[str] = []
    configs: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name, _, inline = arg.partition("=")
        if name in ("--config", "-c", "--stage"):
            value = inline if inline else (args[i + 1] if i + 1 < len(args) else None)
            i += 1 if inline else 2
            if value is None:
                raise SystemExit(f"{name} needs a value")
            if name == "--stage":
                section: dict[str, Any] | None = None
                for cfg in configs:
                    section = read_recipe(cfg).get(f"stage{value}", section)
                if section is None:
                    raise SystemExit(f"--stage {value}: no 'stage{value}:' section in {configs or 'any --config'}")
                out += ["--config", yaml.safe_dump(section, sort_keys=False)]
            else:
                if Path(value).exists() or value.endswith((".yaml", ".yml", ".json")):  # a file, not inline YAML
                    read_recipe(value)  # a missing, binary or non-mapping recipe is refused here, clearly
                    configs.append(value)
                out += ["--config", value]
            continue
        out.append(arg)
        i += 1
    return out


def run_cli(argv: Sequence[str] | None = None, **kwargs: Any) -> LeanKCLI:
    """Build (and by default run) the CLI for ``argv``; returns the LightningCLI with its trainer and model."""
    args = expand_stage(argv) if argv is not None else None
    # argv is given explicitly (leank's own entry point); Lightning warns when sys.argv also has words.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    return LeanKCLI(
        LeanKDistillation,
        NeedleDataModule,
        args=args,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        **kwargs,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry of ``leank fit``: a LightningCLI command line; ``fit`` is implied when no subcommand leads."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in SUBCOMMANDS:
        args = ["fit", *args]
    with one_line_errors("leank fit"):
        run_cli(args)
    return 0


@contextmanager
def one_line_errors(prog: str) -> Iterator[None]:
    """Print a bad input's message as one line and exit 2: our own input errors, Lightning's misconfigurations.

    Anything else is a bug and keeps its traceback.
    """
    try:
        yield
    except (RecipeError, MaskError, BaseModelError, NonFiniteError, MisconfigurationException) as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except UnpicklingError as e:  # torch refused a checkpoint (weights-only loading)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(
            f"{prog}: error: a checkpoint holds more than tensors and plain data and was not loaded "
            f"(torch refuses to unpickle it: {first}); delete it to start the stage afresh",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2) from None


if __name__ == "__main__":
    raise SystemExit(main())
