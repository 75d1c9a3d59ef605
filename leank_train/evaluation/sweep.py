"""A ratio sweep's rows from one pass's answers: each mask's accuracy and cache bytes against its ratio.

Why a module of its own: the same rows come from a sweep run (``leank eval A B``, :func:`.loop.ratio_sweep`)
and from saved runs of ``benchmarks/eval_masks.py`` at several lengths, each with its own probes per task
(one JSON per length): the figure is drawn from the answers either way, never from typed-in numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from leank_infer import ChannelMask

from .report import renamed


def sweep_rows(results: dict[str, Any], masks: Sequence[tuple[str, ChannelMask]], methods: Sequence[str],
               tasks: Sequence[str] | None) -> tuple[dict[int, float], list[dict[str, Any]]]:
    """(the full model's accuracy per length, one row per mask) of a pass whose method ``methods[i]`` is
    mask ``masks[i]``. With ``tasks`` (the suite) an accuracy is the headline score (over the tasks the full
    model passes at that length; NaN where it passes none), and each row carries its per-task cells and
    paired counts against the full model; ``answers`` are the mask's as a one-mask run names them (``leank``)."""
    lengths = [int(n) for n in results["lengths"]]
    full_acc = {} if tasks is not None else {n: results["accuracy"]["full"][n] for n in lengths}
    rows = []
    for (name, mask), method in zip(masks, methods, strict=True):
        one = renamed(results, {"full": "full", method: "leank"})
        s = mask.stats(dtype=torch.bfloat16)
        row = {"mask": name, "ratio": mask.ratio, "k_kept": s["k_kept_fraction"], "v_kept": s["v_kept_fraction"],
               "zero_heads": s["zero_heads"], "bytes_per_token": s["bytes_per_token"],
               "accuracy": {} if tasks is not None else {n: results["accuracy"][method][n] for n in lengths},
               "answers": one["answers"]}
        if tasks is not None:
            row.update({k: v for k, v in one.items() if k not in ("methods", "lengths", "answers")})
            heads = one["headline"]
            row["accuracy"] = {n: heads[n]["leank"]["score"] if "leank" in heads[n] else float("nan")
                               for n in lengths}
            full_acc = {n: heads[n]["full"]["score"] if "full" in heads[n] else float("nan") for n in lengths}
        rows.append(row)
    return full_acc, rows


def merged_sweep(runs: Sequence[dict[str, Any]], masks: Sequence[tuple[str, ChannelMask]],
                 methods: Sequence[Sequence[str]]) -> dict[str, Any]:
    """One sweep over the lengths of several suite runs (``benchmarks/eval_masks.py --json``, one or more lengths
    each): in run ``i`` mask ``masks[j]`` answered as method ``methods[i][j]``. Each length's scores come from
    the run that measured it; ``samples_per_length`` says the probes per task at each length (a run may use
    more probes at one length than at another)."""
    full: dict[int, float] = {}
    rows: list[dict[str, Any]] = [{} for _ in masks]
    samples: dict[int, int] = {}
    for res, names in zip(runs, methods, strict=True):
        if "tasks" not in res:
            raise ValueError("a merged sweep needs suite runs (tasks), not the older needle probes")
        f, part = sweep_rows(res, masks, names, list(res["tasks"]))
        for n in f:
            if n in full:
                raise ValueError(f"two runs measured {n} tokens: give one run per length")
            samples[n] = int(res["samples_per_task"])
        full.update(f)
        for row, new in zip(rows, part, strict=True):
            acc = {**row.get("accuracy", {}), **new["accuracy"]}
            row.update({k: v for k, v in new.items() if k in ("mask", "ratio", "k_kept", "v_kept", "zero_heads",
                                                               "bytes_per_token")}, accuracy=acc)
    lengths = sorted(full)
    per = sorted(set(samples.values()))
    label = str(per[0]) if len(per) == 1 else ", ".join(f"{samples[n]} at {n}" for n in lengths)
    return {"full": full, "masks": rows, "lengths": lengths, "samples_per_length": label, "tasks": True}
