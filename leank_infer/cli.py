"""The ``leank`` console script: one entry, one subcommand per job, each parsed from a typed function.

Every subcommand is a function whose signature is its command line (jsonargparse builds the parser):
parameters before ``*`` are positional, the others ``--name`` options (``--name-with-dashes`` is accepted
too), ``bool`` ones flags (``--card`` / ``--no_card``), ``list`` ones take several values; a dataclass
parameter is a YAML file of its fields (``leank run RECIPE``, any field overridable as ``--key value``).
``fit`` is LightningCLI itself (jsonargparse too). The function module is imported only when its command
runs, so ``leank --help`` is instant and the inference commands work without the training extra.

Errors: a bad argument or input is one line ``leank CMD: error: ...`` and exit code 2, here and only here
(the functions raise their module's error; none exits).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import sys
import typing
from collections.abc import Callable, Sequence
from pickle import UnpicklingError  # the exception only: checkpoints are read weights-only
from typing import Any

from .cli_types import UsageError

# name -> ("module:function", one-line help). ``fit`` takes its argv as is (LightningCLI).
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("leank_train.pipeline:run", "run a recipe: stage 1, stage 2, export, evaluate (resumes when rerun)"),
    "fit": ("leank_train.cli:fit", "one training stage as a plain LightningCLI (fit --config STAGE.yaml)"),
    "eval": ("leank_train.evaluate:eval_command", "long-context accuracy and next-token KL, full vs LeanK vs baselines"),
    "memory": ("leank_train.memory:memory", "device memory of one training step, estimated from a model config"),
    "bench": ("leank_infer.bench:bench", "decode latency, tokens/s and KV bytes, dense vs LeanK (or --estimate)"),
    "generate": ("leank_infer.generate_cli:generate", "answer a prompt dense vs LeanK, with KV bytes of each"),
    "card": ("leank_infer.hub_cli:card", "rewrite mask folders' model cards and pattern.png (no evaluation)"),
    "push": ("leank_infer.hub_cli:push", "upload a mask repo folder to the Hub in one commit"),
    "pull": ("leank_infer.hub_cli:pull", "download a mask repo (revision pinning, Hub cache)"),
    "import": ("leank_infer.reference_import:import_command", "convert a mask released with the reference code (.pth)"),
}
RAW_ARGV = {"fit"}


def _help() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {help_text}" for name, (_, help_text) in COMMANDS.items())
    return (
        "usage: leank COMMAND [ARGS ...]   (leank COMMAND --help for its arguments)\n\n"
        "LeanK: learned static K-channel masks for cheaper long-context decoding.\n\n"
        f"commands:\n{rows}\n"
    )


def _load(name: str) -> Callable[..., Any]:
    target, _ = COMMANDS[name]
    module, func = target.split(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        if module.startswith("leank_train"):
            raise UsageError(
                f"needs the training extra ({e.name} is missing): pip install 'leank[train]'"
            ) from None
        raise
    return getattr(mod, func)


# ---- the parser of a typed function ------------------------------------------------------------------------
def _docs(func: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """(description, parameter help) from a Google-style docstring."""
    doc = inspect.getdoc(func) or ""
    description = doc.split("\n\n")[0].replace("\n", " ")
    params: dict[str, str] = {}
    block = re.split(r"\n\s*Args:\s*\n", doc, maxsplit=1)
    if len(block) == 2:
        for m in re.finditer(r"^\s{4}(\w+):\s*(.*(?:\n\s{8,}.*)*)", block[1], re.M):
            params[m.group(1)] = " ".join(m.group(2).split())
    return description, params


def _list_item(hint: Any) -> Any | None:
    """T for list[T] (or list[T] | None), else None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is not list else [hint]
    for a in args:
        if typing.get_origin(a) is list:
            return typing.get_args(a)[0]
    return None


def command_parser(func: Callable[..., Any], prog: str):
    """A jsonargparse parser whose arguments are ``func``'s parameters (see the module docstring)."""
    from jsonargparse import ActionConfigFile, ActionYesNo, ArgumentParser

    from .cli_types import register

    register()
    description, docs = _docs(func)
    parser = ArgumentParser(prog=prog, description=description, exit_on_error=False)
    hints = typing.get_type_hints(func)
    for p in inspect.signature(func).parameters.values():
        hint, help_text = hints[p.name], docs.get(p.name)
        positional = p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        default = {} if p.default is inspect.Parameter.empty else {"default": p.default}
        if dataclasses.is_dataclass(hint):
            parser.add_argument("--config", action=ActionConfigFile, help=f"{help_text} (a YAML file)")
            parser.add_class_arguments(hint, None)
        elif hint is bool:
            parser.add_argument(f"--{p.name}", action=ActionYesNo, help=help_text, **default)
        elif (item := _list_item(hint)) is not None:
            nargs = "+" if not default or not positional else "*"
            name = p.name if positional else f"--{p.name}"
            extra = {} if positional else {"required": not default}
            parser.add_argument(name, type=item, nargs=nargs, help=help_text, **default, **extra)
        elif positional:
            parser.add_argument(p.name, type=hint, nargs="?" if default else None, help=help_text, **default)
        else:
            parser.add_argument(f"--{p.name}", type=hint, required=not default, help=help_text, **default)
    return parser


def invocation(prog: str, func: Callable[..., Any], values: dict[str, Any]) -> str:
    """The command line that calls ``func`` with ``values`` (defaults left out): printed with results."""
    import shlex

    from .cli_types import PositiveIntList

    hints = typing.get_type_hints(func)
    words: list[str] = []
    for p in inspect.signature(func).parameters.values():
        value = values.get(p.name, p.default)
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD and value == p.default:
            continue
        if value is None or value is inspect.Parameter.empty:
            continue
        if hints[p.name] is bool:
            words.append(f"--{p.name}" if value else f"--no_{p.name}")
            continue
        if hints[p.name] is PositiveIntList:
            value = ",".join(map(str, value))
        items = [str(v) for v in value] if isinstance(value, list | tuple) else [str(value)]
        words += (items if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else [f"--{p.name}", *items])
    return " ".join([prog, *(shlex.quote(w) for w in words)])


def _dashes_to_underscores(argv: Sequence[str]) -> list[str]:
    """``--max-new-tokens 3`` -> ``--max_new_tokens 3`` (the option names only, never values)."""
    out = []
    for arg in argv:
        m = re.match(r"^(--[A-Za-z][\w.-]*)(=.*)?$", arg, re.S)
        out.append(m.group(1).replace("-", "_").replace("__", "--", 1) + (m.group(2) or "") if m else arg)
    return out


def one_line(message: str) -> str:
    """jsonargparse's multi-line message as one line naming the option (``--key: problem``)."""
    text = " ".join(str(message).split())
    # `X | None`: the error of X (not that the value is not None either), with the value given
    union = re.search(r"Does not validate against any of the Union subtypes.*?Errors: - (.*?) - Expected a "
                      r"<class 'NoneType'>.*?(?:Given value: (.*))?$", text)
    if union:
        inner, given = union.group(1), union.group(2)
        if given is not None and "Got value" not in inner and inner.startswith("Expected a typing.Literal"):
            inner = f"{inner}. Got value: {given}"
        text = text[: union.start()] + inner
    text = re.sub(r"Expected a typing\.Literal\[(.*)\]\. Got value: (.*)", r"\2 is not one of \1", text)
    text = re.sub(r'Parser key "([\w.]+)"(?: element \d+)?: (?:Not of type \w+: )?', r"--\1: ", text)
    return text[:1000]


def _build(cls: type, values: dict[str, Any]) -> Any:
    """``cls`` from parsed values; nested dataclasses too, while plain data (dicts) stays plain data."""
    hints = typing.get_type_hints(cls)
    return cls(**{
        f.name: _build(hints[f.name], values[f.name]) if dataclasses.is_dataclass(hints[f.name]) else values[f.name]
        for f in dataclasses.fields(cls) if f.name in values
    })


def call(func: Callable[..., Any], argv: Sequence[str], prog: str) -> int:
    """Parse ``argv`` against ``func``'s signature and call it; its return value is the exit code."""
    return int(func(**parse(func, argv, prog)) or 0)


def parse(func: Callable[..., Any], argv: Sequence[str], prog: str) -> dict[str, Any]:
    """``func``'s keyword arguments from the command line ``argv`` (a bad one: UsageError)."""
    from argparse import ArgumentError

    argv = _dashes_to_underscores(argv)
    params = inspect.signature(func).parameters
    hints = typing.get_type_hints(func)
    recipe = next((p for p in params.values() if dataclasses.is_dataclass(hints[p.name])), None)
    if recipe is not None and argv and not argv[0].startswith("-"):
        from .cli_types import check_config_files

        check_config_files(argv[0])  # a missing, binary, FIFO or non-mapping file: one clear error naming it
        argv = ["--config", argv[0], *argv[1:]]
        check_config_args(argv[2:])
    elif recipe is not None:
        check_config_args(argv)
    parser = command_parser(func, prog)
    try:
        cfg = parser.parse_args(argv)
    except ArgumentError as e:
        raise UsageError(one_line(e.message if hasattr(e, "message") else e)) from None
    values = cfg.as_dict()
    kwargs: dict[str, Any] = {}
    for p in params.values():
        hint = hints[p.name]
        kwargs[p.name] = _build(hint, values) if dataclasses.is_dataclass(hint) else values[p.name]
    return kwargs


def check_config_args(argv: Sequence[str]) -> None:
    """Check every ``--config FILE`` of ``argv`` and the files it includes before jsonargparse opens them: a missing,
    binary, FIFO, huge, alias-bomb or non-mapping file is one clear error naming it (and never quoting it)."""
    from .cli_types import check_config_files

    for i, arg in enumerate(argv):
        value = arg.partition("=")[2] if arg.startswith("--config=") else argv[i + 1] if (
            arg == "--config" and i + 1 < len(argv)) else None
        if value is not None and "\n" not in value and os.path.lexists(value):  # else inline YAML, or missing
            check_config_files(value)


def _input_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean bad input (printed as one line), not a bug (which keeps its traceback)."""
    from .decode.backend import BackendError
    from .folders.cache_root import CacheRootError
    from .mask import MaskError
    from .model.loading import BaseModelError

    errors: list[type[BaseException]] = [UsageError, MaskError, BaseModelError, BackendError, CacheRootError]
    if "leank_train" in sys.modules:  # a training command ran (or tried to)
        try:
            from lightning.fabric.utilities.exceptions import MisconfigurationException

            from leank_train.distill.finite import NonFiniteError
            from leank_train.errors import RecipeError
        except ImportError:  # the training extra is missing: none of these can have been raised
            pass
        else:
            errors += [RecipeError, NonFiniteError, MisconfigurationException]
    return tuple(errors)


def error_line(prog: str, e: BaseException) -> str:
    if isinstance(e, UnpicklingError):  # torch refused a checkpoint (weights-only loading)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (f"{prog}: error: a checkpoint holds more than tensors and plain data and was not loaded "
                f"(torch refuses to unpickle it: {first}); delete it to start the stage afresh")
    text = " ".join(str(e).split())
    # a message may quote a stranger's text (a mask's base_model, a file name): never send escapes to the terminal
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return f"{prog}: error: {text}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry of ``leank``: the only place an error becomes an exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_help(), end="")
        return 0
    name = argv[0]
    prog = f"leank {name}"
    if name not in COMMANDS:
        print(f"leank: error: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        func = _load(name)
        return int(func(argv[1:]) or 0) if name in RAW_ARGV else call(func, argv[1:], prog)
    except UnpicklingError as e:
        print(error_line(prog, e), file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        if isinstance(e, _input_errors()):
            print(error_line(prog, e), file=sys.stderr, flush=True)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
