"""The ``leank`` console script: one entry, one subcommand per job.

Heavy imports happen inside each subcommand, so ``leank --help`` is instant. Subcommands that
need the training extra (``run``, ``fit``, ``eval``) live in ``leank_train`` and say how to install
it when it is missing.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

# name -> (module, function, one-line help). Each function takes the remaining argv.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "run": ("leank_train.pipeline", "main", "run a recipe end to end: stage 1, stage 2, export, evaluate"),
    "fit": ("leank_train.cli", "main", "one training stage as a plain LightningCLI (fit --config ...)"),
    "eval": ("leank_train.evaluate", "main", "retrieval accuracy and next-token KL, full vs LeanK vs baselines"),
    "bench": ("leank_infer.bench", "main", "decode latency, tokens/s and KV bytes, dense vs LeanK (or --estimate)"),
    "generate": ("leank_infer.generate_cli", "main", "answer a prompt dense vs LeanK, with KV bytes of each"),
    "push": ("leank_infer.hub_cli", "push_main", "upload a mask repo folder to the Hub in one commit"),
    "pull": ("leank_infer.hub_cli", "pull_main", "download a mask repo (revision pinning, Hub cache)"),
    "import": ("leank_infer.reference_import", "main", "convert a mask released with the reference code (.pth)"),
}


def _load(name: str) -> Callable[[Sequence[str]], int | None]:
    module, func, _ = COMMANDS[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        if module.startswith("leank_train"):
            raise SystemExit(
                f"leank {name} needs the training extra ({e.name} is missing): pip install 'leank[train]'"
            ) from None
        raise
    return getattr(mod, func)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="leank",
        description="LeanK: learned static K-channel masks for cheaper long-context decoding.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, _, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
    return int(_load(argv[0])(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
