"""Every value of a recipe checked before anything loads or trains.

Why: a stage's own classes check some values when they are built (a mask's sizes when it is exported,
after the stage trained), and some values are not wrong to Lightning at all (``max_steps: -1`` means
"no limit": 4,000 silent steps). ``leank run`` checks the whole recipe first, each problem named as the
option that sets it (``--stage1.steps: must be at least 1, got -1``).
"""

from __future__ import annotations

import math
from typing import Any

from leank_infer.decode.rule import RuleError, check_rule
from leank_infer.mask.format import MAX_TOKENS

from .errors import RecipeError
from .recipe import Recipe, Stage, Stage2


def _integer(value: Any, low: int, high: int = MAX_TOKENS) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an integer, got {value!r}"
    if not low <= value <= high:
        return f"must be at least {low}, got {value}" if value < low else f"must be at most {high:,}, got {value:,}"
    return None


def _number(value: Any, low: float, high: float, open_high: bool = False) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if not (low <= value < high if open_high else low <= value <= high):
        return f"must be in [{low:g}, {high:g}{')' if open_high else ']'}, got {value}"
    return None


def _stage_problems(name: str, st: Stage) -> list[str]:
    checks = {
        "steps": _integer(st.steps, 1), "num_samples": _integer(st.num_samples, 1),
        "lr": _number(st.lr, 0.0, math.inf) or (None if st.lr > 0 else f"must be above 0, got {st.lr}"),
        "reg_weight": _number(st.reg_weight, 0.0, math.inf), "seed": _integer(st.seed, 0, 2**32 - 1),
        "warmup_steps": None if st.warmup_steps is None else _integer(st.warmup_steps, 0),
    }
    if isinstance(st, Stage2):  # the binarisation's own settings
        checks.update({
            "ratio_start": None if st.ratio_start is None else _number(st.ratio_start, 0.0, 1.0, open_high=True),
            "ratio_anneal_steps": _integer(st.ratio_anneal_steps, 0), "min_kept": _integer(st.min_kept, 0, 1 << 16),
        })
    return [f"--{name}.{k}: {v}" for k, v in checks.items() if v]


def student_rule_problem(rule: str) -> str | None:
    """What is wrong with a ``student_rule`` (None: a rule of :data:`~leank_infer.decode.rule.RULES`)."""
    try:
        check_rule(rule)
    except RuleError as e:
        return str(e)
    return None


def recipe_problems(recipe: Recipe) -> list[str]:
    """What is wrong in ``recipe``, one ``--key: problem`` per value (empty when nothing is)."""
    checks = {
        "sink_size": _integer(recipe.sink_size, 0), "recent_size": _integer(recipe.recent_size, 1),
        "decode_recent_size": _integer(recipe.decode_recent_size, 0), "accumu_size": _integer(recipe.accumu_size, 1),
        "ratio": _number(recipe.ratio, 0.0, 1.0, open_high=True), "align": _integer(recipe.align, 1, 1 << 16),
        "warmup_steps": _integer(recipe.warmup_steps, 0), "min_lr_ratio": _number(recipe.min_lr_ratio, 0.0, 1.0),
        "min_length": _integer(recipe.min_length, 1), "max_length": _integer(recipe.max_length, 1),
        "length_intervals": _integer(recipe.length_intervals, 1), "batch_size": _integer(recipe.batch_size, 1),
        "seed": _integer(recipe.seed, 0, 2**32 - 1), "checkpoint_every": _integer(recipe.checkpoint_every, 1),
        "haystacks": None if recipe.haystacks else "must name at least one haystack",
        "student_rule": student_rule_problem(recipe.student_rule),
    }
    out = [f"--{k}: {v}" for k, v in checks.items() if v]
    if not out and recipe.max_length < recipe.min_length:
        out.append(f"--max_length: must be at least --min_length ({recipe.min_length}), got {recipe.max_length}")
    return out + _stage_problems("stage1", recipe.stage1) + _stage_problems("stage2", recipe.stage2)


def check_recipe(recipe: Recipe) -> None:
    """Raise RecipeError naming every bad value of ``recipe`` (before anything loads or trains)."""
    problems = recipe_problems(recipe)
    if problems:
        raise RecipeError("; ".join(problems))
