"""Statistics of an evaluation: Wilson intervals per cell, paired comparisons against the full model on the
same probes, and the headline score over the tasks the full model passes.

Why these: accuracies near 1 on a few dozen probes make the normal-approximation interval useless (it
collapses to a point at 100%); Wilson's does not. Every method answers the same probes, so a paired count
(probes only the full model gets right vs probes only the method gets right) says more than two
independent accuracies, and McNemar's exact test turns it into a p-value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

#: the full model must reach this accuracy on a (task, length) for the task to count in the headline
PASS_THRESHOLD = 0.8


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% for the default ``z``); (0, 1) when ``n`` is 0."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_counts(full: Sequence[bool], method: Sequence[bool]) -> dict[str, int]:
    """On the same probes: both right, only the full model right, only the method right, neither."""
    if len(full) != len(method):
        raise ValueError(f"paired counts need the same probes: {len(full)} vs {len(method)} answers")
    pairs = list(zip(full, method, strict=True))
    return {"both": sum(a and b for a, b in pairs), "only_full": sum(a and not b for a, b in pairs),
            "only_method": sum(b and not a for a, b in pairs), "neither": sum(not a and not b for a, b in pairs)}


def mcnemar_p(only_full: int, only_method: int) -> float:
    """Exact two-sided McNemar test: p-value of the discordant pairs splitting this unevenly by chance."""
    n = only_full + only_method
    if n == 0:
        return 1.0
    k = min(only_full, only_method)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def probes_for_se(accuracies: Sequence[float], target_se: float = 0.03) -> int:
    """Probes per task so that the mean over these tasks has standard error <= ``target_se``.

    The headline is a mean of ``k`` task accuracies with ``n`` probes each: SE^2 = sum p(1-p) / (n k^2).
    Accuracies of 0 or 1 are taken as 1/(2n)-ish by flooring p(1-p) at 0.02 (a perfect score on few probes
    does not prove zero variance).
    """
    if not accuracies:
        return 0
    k = len(accuracies)
    var = sum(max(p * (1 - p), 0.02) for p in accuracies)
    return math.ceil(var / (k * k * target_se * target_se))


def summarize(answers: list[dict[str, Any]], methods: Sequence[str], lengths: Sequence[int],
              tasks: Sequence[str]) -> dict[str, Any]:
    """Per-(task, length, method) cells, paired comparisons with ``full``, and the headline per length.

    ``answers`` rows carry ``kind`` (the task), ``length`` and ``correct`` (method -> bool), in probe order.
    The headline at a length is the mean accuracy over the tasks where the full model scores
    >= ``PASS_THRESHOLD`` there (listed), with its standard error; without ``full`` there is none.
    """
    cells: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    for task in tasks:
        cells[task] = {}
        for method in methods:
            cells[task][method] = {}
            for length in lengths:
                rows = [r for r in answers if r["kind"] == task and r["length"] == length]
                if not rows:
                    continue
                ok = [bool(r["correct"][method]) for r in rows]
                k, n = sum(ok), len(ok)
                cell: dict[str, Any] = {"correct": k, "n": n, "accuracy": k / n, "wilson95": list(wilson_interval(k, n))}
                if method != "full" and "full" in methods:
                    paired = paired_counts([bool(r["correct"]["full"]) for r in rows], ok)
                    cell["paired"] = {**paired, "mcnemar_p": mcnemar_p(paired["only_full"], paired["only_method"])}
                cells[task][method][length] = cell
    headline: dict[int, dict[str, Any]] = {}
    if "full" in methods:
        for length in lengths:
            passing = [t for t in tasks if length in cells[t]["full"]
                       and cells[t]["full"][length]["accuracy"] >= PASS_THRESHOLD]
            entry: dict[str, Any] = {"tasks": passing}
            for method in methods:
                cs = [cells[t][method][length] for t in passing]
                if not cs:
                    continue
                score = sum(c["accuracy"] for c in cs) / len(cs)
                se = math.sqrt(sum(c["accuracy"] * (1 - c["accuracy"]) / c["n"] for c in cs)) / len(cs)
                entry[method] = {"score": score, "se": se}
                if method != "full":
                    totals = {key: sum(c["paired"][key] for c in cs) for key in ("both", "only_full", "only_method")}
                    entry[method]["paired"] = {**totals, "mcnemar_p": mcnemar_p(totals["only_full"],
                                                                               totals["only_method"])}
            fulls = [cells[t]["full"][length]["accuracy"] for t in passing]
            entry["probes_for_se_0.03"] = probes_for_se(fulls)
            headline[length] = entry
    return {"tasks": cells, "headline": headline}
