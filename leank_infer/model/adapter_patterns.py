"""A PEFT adapter's module patterns, resolved by leank with a time limit before peft sees them.

A mask may name a stranger's adapter, and peft matches an adapter config's ``target_modules`` (a
string is a regular expression, ``re.fullmatch``-ed against every module name) and interpolates
``modules_to_save``, ``layers_pattern`` and the ``rank_pattern``/``alpha_pattern`` keys into
expressions of its own. ``re`` has no time limit: ``(.*.*)*y`` backtracks for hours on one module
name. So a regular expression is matched here, with the ``regex`` package's timeout (transformers
depends on it), and peft receives the list of module names it matched (so too IA3's
``feedforward_modules``, which peft ``re.fullmatch``-es the same way); the interpolated fields, and every
``*_pattern`` field (their keys are matched by peft), must be plain module names.
"""

from __future__ import annotations

import re
import time
from typing import Any

MATCH_SECONDS = 2.0  # all module names of one adapter field together
ALL_LINEAR = "all-linear"  # peft's own shorthand, not an expression
_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


class AdapterPatternError(ValueError):
    """An adapter config's module pattern is unsafe or matches nothing; the message says which."""


def _resolve(pattern: str, names: list[str], field: str, seconds: float) -> set[str]:
    """The module ``names`` that ``pattern`` fully matches, within ``seconds`` in all."""
    import regex

    try:
        compiled = regex.compile(pattern)
    except regex.error as e:
        raise AdapterPatternError(f"{field} {pattern[:80]!r} is not a valid regular expression: {e}") from None
    deadline = time.monotonic() + seconds
    found = set()
    for name in names:
        left = deadline - time.monotonic()
        try:
            if left <= 0 or compiled.fullmatch(name, timeout=left):
                if left <= 0:
                    raise TimeoutError
                found.add(name)
        except TimeoutError:
            raise AdapterPatternError(
                f"{field} {pattern[:80]!r} takes more than {seconds:g} s to match the model's module names "
                "(a regular expression that backtracks without end); name the modules instead"
            ) from None
    return found


# peft fields that are a regular expression when given as a string (``re.fullmatch`` against every module name):
# matched here, bounded, and handed to peft as the set of names they matched
REGEX_FIELDS = ("target_modules", "exclude_modules", "feedforward_modules")
# peft fields it interpolates into expressions of its own (a dict: its keys): plain module names only
PLAIN_FIELDS = ("modules_to_save", "layers_pattern", "target_parameters")


def _plain_fields(config: Any) -> list[str]:
    """:data:`PLAIN_FIELDS` and every ``*_pattern`` field of the config (``rank_pattern``, ``alpha_pattern``,
    ``n_frequency_pattern``, ``block_size_pattern``, ``lambda_pattern``...: peft matches their keys)."""
    names = set(PLAIN_FIELDS) | {n for n in vars(config) if n.endswith("_pattern")}
    return sorted(names)


def resolve_adapter_patterns(config: Any, module_names: list[str], seconds: float = MATCH_SECONDS) -> Any:
    """``config`` (a peft config) with its expressions resolved: every :data:`REGEX_FIELDS` field given as a string
    (LoRA's ``target_modules``, IA3's ``feedforward_modules``...) becomes the set of module names it matches
    (within ``seconds`` each); the fields peft builds expressions from must be plain names. Raises
    :class:`AdapterPatternError`."""
    for field in REGEX_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, str) and value != ALL_LINEAR:
            matched = _resolve(value, module_names, field, seconds)
            if field == "target_modules" and not matched:
                raise AdapterPatternError(f"target_modules {value[:80]!r} matches no module of the model")
            setattr(config, field, matched)
    for field in _plain_fields(config):
        value = getattr(config, field, None)
        items = [value] if isinstance(value, str) else list(value or ())  # a dict: its keys
        bad = [str(v)[:80] for v in items if not isinstance(v, str) or not _PLAIN.fullmatch(v)]
        if bad:
            raise AdapterPatternError(
                f"{field} {bad[:3]} must be plain module names (letters, digits, '_', '.', '-'): peft turns them "
                "into regular expressions, which a stranger's adapter could make backtrack without end"
            )
    return config
