"""A ratio sweep from saved runs at several lengths (leank_train.evaluation.sweep.merged_sweep): each length's
scores come from the run that measured it, each mask's from its own method in that run (issue #34)."""

from __future__ import annotations

import math

import pytest
import torch

from leank_infer import ChannelMask
from leank_train.evaluation.stats import summarize
from leank_train.evaluation.sweep import merged_sweep


def _run(length: int, correct: dict[str, list[bool]], tasks=("passkey", "niah_single_number")) -> dict:
    """A saved suite run: ``correct[method]`` per probe, the probes split evenly over ``tasks``."""
    n = len(correct["full"])
    answers = [{"kind": tasks[i % len(tasks)], "length": length, "correct": {m: c[i] for m, c in correct.items()}}
               for i in range(n)]
    methods = list(correct)
    res = {"methods": methods, "lengths": [length], "answers": answers, "samples_per_task": n // len(tasks)}
    return {**res, **summarize(answers, methods, [length], list(tasks))}


def _mask(ratio: float) -> ChannelMask:
    scores = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(int(ratio * 100)))
    return ChannelMask.from_scores(scores, ratio, 4, sink_size=4, recent_size=8, accumu_size=4, base_model="m")


def test_each_length_and_mask_scores_from_its_own_run_and_method():
    t, f = True, False
    short = _run(1024, {"full": [t] * 8, "leank-r50": [t] * 8, "leank-r75": [t, f] * 4})
    # probes alternate passkey, number: at 4096 the full model gets passkey 4/4 and the number task 2/4
    long = _run(4096, {"full": [t, t, t, f, t, t, t, f], "leank-r75": [f] * 8, "leank-r50": [t] * 6 + [f, t]})
    masks = [("a", _mask(0.5)), ("b", _mask(0.75))]
    sweep = merged_sweep([short, long], masks, [["leank-r50", "leank-r75"], ["leank-r50", "leank-r75"]])
    assert sweep["lengths"] == [1024, 4096]
    # 4096: the full model passes passkey (4/4) but not the number task (2/4): the headline is passkey alone
    assert sweep["full"] == {1024: 1.0, 4096: 1.0}
    a, b = sweep["masks"]
    assert (a["mask"], a["ratio"], b["ratio"]) == ("a", 0.5, 0.75)
    assert a["accuracy"] == {1024: 1.0, 4096: 0.75}  # the headline of 4096 is passkey alone: 3 of 4
    assert b["accuracy"] == {1024: 0.5, 4096: 0.0}
    assert a["bytes_per_token"] == masks[0][1].stats(dtype=torch.bfloat16)["bytes_per_token"]
    assert sweep["samples_per_length"] == "4"


def test_probes_per_task_are_told_per_length_and_a_length_is_measured_once():
    t = True
    one = _run(1024, {"full": [t] * 8, "leank-r50": [t] * 8})
    two = _run(8192, {"full": [t] * 4, "leank-r50": [t, False] * 2}, tasks=("passkey",))
    sweep = merged_sweep([one, two], [("a", _mask(0.5))], [["leank-r50"], ["leank-r50"]])
    assert sweep["samples_per_length"] == "4"  # the same at every length: one number
    three = _run(8192, {"full": [t] * 6, "leank-r50": [t] * 6}, tasks=("passkey",))
    assert merged_sweep([one, three], [("a", _mask(0.5))], [["leank-r50"]] * 2)["samples_per_length"] == \
        "4 at 1024, 6 at 8192"
    with pytest.raises(ValueError, match="two runs measured 8192"):
        merged_sweep([two, three], [("a", _mask(0.5))], [["leank-r50"]] * 2)
    # a length where the full model passes no task has no headline: NaN, not a score
    none = _run(2048, {"full": [False] * 4, "leank-r50": [t] * 4})
    assert math.isnan(merged_sweep([none], [("a", _mask(0.5))], [["leank-r50"]])["masks"][0]["accuracy"][2048])
