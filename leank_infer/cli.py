"""The ``leank`` console script: one entry, one subcommand per job, each parsed from a typed function.

Every subcommand is a function whose signature is its command line (jsonargparse builds the parser):
parameters before ``*`` are positional, the others ``--name`` options (``--name-with-dashes`` is accepted
too), ``bool`` ones flags (``--card`` / ``--no_card``), ``list`` ones take several values, space-separated
(``--lengths 1024 2048``; jsonargparse's ``[1024,2048]`` works too; the older comma form ``1024,2048`` still
parses, with a deprecation warning); a dataclass parameter is a YAML file of its fields (``leank run RECIPE.yaml``,
any field overridable as ``--key value``, its lists the same way). A docstring's ``Args:`` are the options'
help and its ``Examples:`` the help's last lines.
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
import textwrap
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
        "usage: leank COMMAND [ARGS ...]   (leank COMMAND --help for its arguments and examples)\n\n"
        "LeanK: learned static K-channel masks for cheaper long-context decoding.\n\n"
        f"commands:\n{rows}\n\n"
        "Options are --name value (--name-with-dashes works too), lists space-separated (--lengths 1024 2048).\n\n"
        "examples:\n"
        "  leank generate hub/smollm2-135m-instruct-s3 --prompt \"$(cat README.md) What does LeanK prune?\" --chat\n"
        "  leank eval hub/smollm2-135m-instruct-s3 --quick\n"
        "  leank run recipes/smollm2-135m.yaml\n"
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
def _docs(func: Callable[..., Any]) -> tuple[str, dict[str, str], str]:
    """(description, parameter help, examples) from a Google-style docstring."""
    doc = inspect.getdoc(func) or ""
    description = doc.split("\n\n")[0].replace("\n", " ")
    params: dict[str, str] = {}
    examples = ""
    sections = re.split(r"\n\s*(Args|Examples):\s*\n", doc)
    for title, body in zip(sections[1::2], sections[2::2], strict=True):
        body = re.split(r"\n(?=\S)", body, maxsplit=1)[0]  # up to the next unindented line
        if title == "Args":
            for m in re.finditer(r"^\s{4}(\w+):\s*(.*(?:\n\s{8,}.*)*)", body, re.M):
                params[m.group(1)] = " ".join(m.group(2).split())
        else:
            examples = textwrap.dedent(body).strip("\n")
    return description, params, examples


def _help_formatter() -> type:
    """jsonargparse's help formatter, keeping the examples' lines as written, and saying of a recipe key with no
    default that the recipe sets it (jsonargparse would mark it required, as if it had to be typed)."""
    from argparse import RawDescriptionHelpFormatter

    from jsonargparse import DefaultHelpFormatter

    class HelpFormatter(RawDescriptionHelpFormatter, DefaultHelpFormatter):
        def _get_help_string(self, action: Any) -> str:
            text = super()._get_help_string(action)
            if getattr(action, "leank_recipe_key", False):
                text = text.replace("(required, ", "(no default: the recipe sets it; ", 1)
            return text

    return HelpFormatter


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
    description, docs, examples = _docs(func)
    hints = typing.get_type_hints(func)
    params = list(inspect.signature(func).parameters.values())
    recipe = next((p for p in params if dataclasses.is_dataclass(hints[p.name])), None)
    usage = None
    if recipe is not None:  # its YAML file comes first: `leank run RECIPE.yaml --key value ...`
        flags = " ".join(f"[--{p.name}]" if hints[p.name] is bool else
                         f"[--{p.name} {_choices(hints[p.name]).get('metavar', p.name.upper())}]"
                         for p in params if p is not recipe)
        usage = f"%(prog)s {recipe.name.upper()}.yaml {flags} [--KEY VALUE ...]"
    parser = ArgumentParser(prog=prog, description=textwrap.fill(description, 79), usage=usage,
                            epilog=f"examples:\n{textwrap.indent(examples, '  ')}" if examples else None,
                            formatter_class=_help_formatter(), exit_on_error=False)
    for p in params:
        hint, help_text = hints[p.name], docs.get(p.name)
        positional = p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        default = {} if p.default is inspect.Parameter.empty else {"default": p.default}
        if p is recipe:
            parser.add_argument("--config", action=ActionConfigFile, metavar=f"{p.name.upper()}.yaml",
                                help=f"{help_text} It comes first ({prog} {p.name.upper()}.yaml); every "
                                     "option below is one of its keys.")
            parser.add_class_arguments(hint, None)
            lists = _dataclass_lists(hint)
            for action in parser._actions:  # given by the recipe file, or on the command line: not typed required
                if action.required:
                    action.leank_recipe_key = True
                if action.dest in lists:  # shown as the signatures' lists are: space-separated
                    word = action.dest.rsplit(".", 1)[-1].upper()
                    action.metavar = f"{word} [{word} ...]"
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
            parser.add_argument(f"--{p.name}", type=hint, required=not default, help=help_text, **default,
                                **_choices(hint))
    return parser


def _choices(hint: Any) -> dict[str, str]:
    """``metavar="{int8,int4}"`` for ``Literal[...] | None`` (argparse shows a plain Literal's choices itself)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) == 1 and typing.get_origin(args[0]) is typing.Literal:
        return {"metavar": "{" + ",".join(map(str, typing.get_args(args[0]))) + "}"}
    return {}


def invocation(prog: str, func: Callable[..., Any], values: dict[str, Any]) -> str:
    """The command line that calls ``func`` with ``values`` (defaults left out): printed with results."""
    import shlex

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
        items = [f"{v:g}" if isinstance(v, float) else str(v)
                 for v in (value if isinstance(value, list | tuple) else [value])]
        words += (items if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else [f"--{p.name}", *items])
    return " ".join([prog, *(shlex.quote(w) for w in words)])


def _dashes_to_underscores(argv: Sequence[str]) -> list[str]:
    """``--max-new-tokens 3`` -> ``--max_new_tokens 3`` (the option names only, never values)."""
    out = []
    for arg in argv:
        m = re.match(r"^(--[A-Za-z][\w.-]*)(=.*)?$", arg, re.S)
        out.append(m.group(1).replace("-", "_").replace("__", "--", 1) + (m.group(2) or "") if m else arg)
    return out


_OPTION_WORD = re.compile(r"^-[A-Za-z-]")  # an option (``-5`` is a value: a negative number)


def _dataclass_lists(cls: type, prefix: str = "") -> dict[str, Any]:
    """The list-typed keys of a dataclass (nested ones dotted) -> their item type."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_dataclass_lists(hints[f.name], f"{prefix}{f.name}."))
        elif (item := _list_item(hints[f.name])) is not None:
            out[prefix + f.name] = item
    return out


def _lists(argv: Sequence[str], func: Callable[..., Any], prog: str) -> list[str]:
    """One list syntax for every command: ``--key A B C`` (jsonargparse's ``[A,B,C]`` too). A signature's list
    option takes the words as they are (argparse's ``nargs``); a recipe key (jsonargparse's list type, one value)
    takes them as one JSON list. The older comma form ``A,B,C`` of a number list still parses, with a warning."""
    import json

    import yaml

    hints = typing.get_type_hints(func)
    spread: dict[str, Any] = {}  # option -> item type
    joined: dict[str, Any] = {}
    for p in inspect.signature(func).parameters.values():
        hint = hints[p.name]
        if dataclasses.is_dataclass(hint):
            joined.update(_dataclass_lists(hint))
        elif p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD and (item := _list_item(hint)) is not None:
            spread[p.name] = item
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        name, eq, inline = arg.partition("=")
        key = name[2:] if name.startswith("--") else ""
        item = spread.get(key, joined.get(key.removesuffix("+")))  # `--key+ A B`: jsonargparse's append
        if item is None:
            out.append(arg)
            continue
        words = [inline] if eq else []
        while not eq and i < len(argv) and not _OPTION_WORD.match(argv[i]):
            words.append(argv[i])
            i += 1
        numbers = isinstance(item, type) and issubclass(item, int | float) and item is not bool
        values: list[str] = []
        for word in words:
            if word.startswith("[") and word.endswith("]"):  # jsonargparse's form
                if key in joined:
                    values.append(word)
                    continue
                try:
                    loaded = yaml.safe_load(word)
                except yaml.YAMLError:
                    loaded = None
                values += [str(v) for v in loaded] if isinstance(loaded, list) else [word]
            elif numbers and "," in word:
                parts = [w for w in word.split(",") if w]
                print(f"{prog}: warning: {name} {word}: comma-separated lists are deprecated; give the values "
                      f"space-separated: {name} {' '.join(parts)}", file=sys.stderr, flush=True)
                values += parts
            else:
                values.append(word)
        if key in spread or not values or (len(values) == 1 and values[0].startswith("[")) or values == ["null"]:
            out += [name, *values]
            continue
        out += [name, json.dumps([w if item is str else _yaml_scalar(w) for w in values])]
    return out


def _yaml_scalar(word: str) -> Any:
    """A command-line word as the YAML value it spells (``1024`` -> 1024), else the word itself."""
    import yaml

    try:
        return yaml.safe_load(word)
    except yaml.YAMLError:
        return word


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

    params = inspect.signature(func).parameters
    hints = typing.get_type_hints(func)
    recipe = next((p for p in params.values() if dataclasses.is_dataclass(hints[p.name])), None)
    if recipe is not None:  # the recipe file (a path that exists, read as such) may have any name
        check_argv_text(argv[1:] if argv and not argv[0].startswith("-") else argv)
    argv = _lists(_dashes_to_underscores(argv), func, prog)
    recipe_file = argv[0] if recipe is not None and argv and not argv[0].startswith("-") else None
    if recipe_file is not None:
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
        message = one_line(e.message if hasattr(e, "message") else e)
        missing = re.match(r"the following arguments are required: (.*)", message)
        if recipe is not None and missing:  # keys with no default that neither the file nor the command line set
            where = f"the recipe {recipe_file}" if recipe_file else "no recipe given; the command line"
            keys = missing.group(1).split(", ")
            raise UsageError(f"{where} sets no {', '.join(keys)}: set {'them' if len(keys) > 1 else 'it'} in the "
                             f"recipe, or as --{keys[0]} VALUE (usage: {prog} RECIPE.yaml [--KEY VALUE ...])") from None
        raise UsageError(message) from None
    values = cfg.as_dict()
    kwargs: dict[str, Any] = {}
    for p in params.values():
        hint = hints[p.name]
        kwargs[p.name] = _build(hint, values) if dataclasses.is_dataclass(hint) else values[p.name]
    return kwargs


def check_argv_text(argv: Sequence[str]) -> None:
    """Every recipe value on the command line is text (a UsageError naming its option, else): a shell passes a
    byte that is not UTF-8 as a lone surrogate (PEP 383), which jsonargparse takes and a stage then fails on when
    it writes the value (its YAML config, its logs). ``--config`` values are files, checked as such."""
    from .cli_types import check_text

    flag = "the command line"
    for i, word in enumerate(argv):
        if (i and argv[i - 1] == "--config") or word.startswith("--config="):
            continue  # a file, checked as such
        if _OPTION_WORD.match(word):  # `--key=value`: the value's characters are counted from its start
            flag, _, word = word.partition("=")
            check_text(flag, flag)
        check_text(flag, word)


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
