"""Evaluation statistics (leank_train.evaluation.stats) and how they reach the table, the JSON and the model card."""

from __future__ import annotations

import pytest

from leank_train.evaluation.stats import mcnemar_p, paired_counts, probes_for_se, summarize, wilson_interval


def test_wilson_interval_matches_the_textbook_values():
    lo, hi = wilson_interval(8, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)
    lo, hi = wilson_interval(10, 10)  # a perfect score still has room below
    assert round(lo, 4) == 0.7225 and hi == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_paired_counts_and_exact_mcnemar():
    full = [True, True, True, False, True, False]
    meth = [True, False, False, False, True, True]
    assert paired_counts(full, meth) == {"both": 2, "only_full": 2, "only_method": 1, "neither": 1}
    assert mcnemar_p(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_p(3, 3) == 1.0 and mcnemar_p(0, 0) == 1.0
    with pytest.raises(ValueError, match="same probes"):
        paired_counts([True], [True, False])


def test_probes_for_se():
    # 8 tasks at p = 0.9: SE^2 = 8 * 0.09 / (n * 64) <= 0.0009  ->  n >= 12.5
    assert probes_for_se([0.9] * 8) == 13
    assert probes_for_se([1.0] * 4) == 6  # p(1-p) floored at 0.02


def _answers():
    """Task a: full 5/5, leank 4/5; task b: full 2/5 (not in the headline); length 100."""
    rows = []
    for i in range(5):
        rows.append({"kind": "a", "length": 100, "correct": {"full": True, "leank": i != 0}})
        rows.append({"kind": "b", "length": 100, "correct": {"full": i < 2, "leank": i in (2, 3, 4)}})
    return rows


def test_summary_cells_paired_counts_and_headline():
    s = summarize(_answers(), ["full", "leank"], [100], ["a", "b"])
    a = s["tasks"]["a"]["leank"][100]
    assert (a["correct"], a["n"], a["accuracy"]) == (4, 5, 0.8)
    assert a["paired"]["only_full"] == 1 and a["paired"]["only_method"] == 0
    assert s["tasks"]["b"]["leank"][100]["paired"] == {"both": 0, "only_full": 2, "only_method": 3, "neither": 0,
                                                       "mcnemar_p": 1.0}
    h = s["headline"][100]
    assert h["tasks"] == ["a"]  # b: the full model scores 40% there
    assert h["full"]["score"] == 1.0 and h["leank"]["score"] == 0.8
    assert h["leank"]["se"] == pytest.approx((0.8 * 0.2 / 5) ** 0.5)
    assert h["leank"]["paired"]["only_full"] == 1


def test_card_model_index_has_one_headline_per_length_and_method(tmp_path):
    """Through huggingface_hub's own EvalResult / ModelCardData round trip: each length's headline of each method
    survives in the metadata; every task row, with its interval and paired counts, stays in eval.json and the
    card's table."""
    import json

    import torch
    from huggingface_hub import ModelCard

    from leank_infer import ChannelMask
    from leank_infer.hub.card import write_model_card
    from leank_train.evaluate import card_results, format_table

    rows = _answers() + [{**r, "length": 200} for r in _answers()]
    res = {"methods": ["full", "leank"], "lengths": [100, 200],
           **summarize(rows, ["full", "leank"], [100, 200], ["a", "b"])}
    res = json.loads(json.dumps(res))  # as read back from --json: lengths become strings
    res["lengths"] = [100, 200]
    ChannelMask.from_scores(torch.rand(2, 2, 16), 0.5, 4).save_pretrained(tmp_path)
    write_model_card(tmp_path, card_results(res, "leank eval x"))
    card = ModelCard.load(tmp_path / "README.md")
    got = {(r.dataset_args["task"], r.dataset_args["length"], r.metric_config): r for r in card.data.eval_results}
    assert set(got) == {("headline", n, m) for n in (100, 200) for m in ("full", "leank")}
    assert got[("headline", 100, "leank")].dataset_args["tasks"] == ["a"]
    assert got[("headline", 200, "leank")].metric_value == 0.8
    kept = {(r["dataset_args"]["task"], r["dataset_args"]["length"], r["metric_config"]): r
            for r in json.loads((tmp_path / "eval.json").read_text())["results"]}
    r = kept[("a", 200, "leank")]
    assert r["dataset"] == "leank-ruler a, 200 tokens" and r["metric"] == "accuracy (leank)"
    assert r["value"] == 0.8 and r["metric_args"]["paired_vs_full"]["only_full"] == 1
    assert r["metric_args"]["wilson95"] == pytest.approx(list(wilson_interval(4, 5)))
    # the card's table carries the counts and the paired differences
    assert "| a | 5/5 | 4/5 (-1/+0) |" in card.text and "| b | 2/5 | 3/5 (-2/+3) |" in card.text
    table = format_table(res)
    assert "| a | leank | 4/5 0.80 [0.38, 0.96] -1/+0 | 4/5 0.80 [0.38, 0.96] -1/+0 |" in table
    assert "headline tasks at 100 tokens (1): a" in table


def test_renamed_gives_one_mask_its_own_methods_and_pairs_them_with_the_full_model():
    """One pass, two masks with baselines: each card gets full/leank/random/think summarized on its own."""
    from leank_train.evaluation.report import renamed

    rows = [{"kind": "a", "length": 100, "index": i, "leank-r70": "x", "leank-r80": "y",
             "correct": {"full": True, "leank-r70": True, "leank-r80": i > 1, "random-r80": False}}
            for i in range(5)]
    methods = ["full", "leank-r70", "leank-r80", "random-r80"]
    res = {"methods": methods, "lengths": [100], "answers": rows, **summarize(rows, methods, [100], ["a"])}
    r80 = renamed(res, {"full": "full", "leank-r80": "leank", "random-r80": "random", "think-r80": "think"})
    assert r80["methods"] == ["full", "leank", "random"]  # think-r80 never answered: left out
    assert r80["tasks"]["a"]["leank"][100]["correct"] == 3
    assert r80["tasks"]["a"]["leank"][100]["paired"]["only_full"] == 2
    assert r80["tasks"]["a"]["random"][100]["correct"] == 0
    assert r80["headline"][100]["leank"]["score"] == 0.6
    assert r80["answers"][0]["leank"] == "y" and "leank-r70" not in r80["answers"][0]


# ---- issue #31 items 4-6: the headline's threshold, its standard error, and the card's headline values ----------
def _rows(task: str, n: int, right: dict[str, int], length: int = 100) -> list[dict]:
    """``n`` probes of ``task``; method m answers the first ``right[m]`` of them right."""
    return [{"kind": task, "length": length, "correct": {m: i < k for m, k in right.items()}} for i in range(n)]


def test_a_task_the_full_model_passes_at_exactly_80_percent_counts_in_the_headline():
    """Item 5: 20 of 25 (the report's probe count) is exactly the threshold, and counts; 19 of 25 does not."""
    rows = _rows("at", 25, {"full": 20, "leank": 10}) + _rows("below", 25, {"full": 19, "leank": 19})
    h = summarize(rows, ["full", "leank"], [100], ["at", "below"])["headline"][100]
    assert h["tasks"] == ["at"] and h["leank"]["score"] == 0.4


def test_the_headline_standard_error_over_several_tasks_is_that_of_their_mean():
    """Item 6: SE of a mean of k task accuracies = sqrt(sum p(1-p)/n) / k (not / sqrt(k)); three passing tasks."""
    rows = (_rows("a", 10, {"full": 10, "leank": 9}) + _rows("b", 20, {"full": 18, "leank": 10})
            + _rows("c", 5, {"full": 5, "leank": 2}))
    h = summarize(rows, ["full", "leank"], [100], ["a", "b", "c"])["headline"][100]
    assert h["tasks"] == ["a", "b", "c"]
    ps = [(0.9, 10), (0.5, 20), (0.4, 5)]
    assert h["leank"]["score"] == pytest.approx(sum(p for p, _ in ps) / 3)
    assert h["leank"]["se"] == pytest.approx((sum(p * (1 - p) / n for p, n in ps)) ** 0.5 / 3)
    assert h["full"]["se"] == pytest.approx((0.9 * 0.1 / 20) ** 0.5 / 3)


def test_the_cards_headline_value_of_each_method_is_that_methods_score(tmp_path):
    """Item 4: the model index's headline row of a method carries that method's score (and its text), not the
    full model's."""
    import torch
    from huggingface_hub import ModelCard

    from leank_infer import ChannelMask
    from leank_infer.hub.card import write_model_card
    from leank_train.evaluate import card_results

    methods = ["full", "leank", "random"]
    rows = _rows("a", 10, {"full": 10, "leank": 8, "random": 3}) + _rows("b", 10, {"full": 9, "leank": 6, "random": 1})
    res = {"methods": methods, "lengths": [100], **summarize(rows, methods, [100], ["a", "b"])}
    ChannelMask.from_scores(torch.rand(2, 2, 16), 0.5, 4).save_pretrained(tmp_path)
    write_model_card(tmp_path, card_results(res, "leank eval x"))
    card = ModelCard.load(tmp_path / "README.md")
    heads = {r.metric_config: r for r in card.data.eval_results if r.dataset_args["task"] == "headline"}
    scores = {m: res["headline"][100][m]["score"] for m in methods}
    assert scores == pytest.approx({"full": 0.95, "leank": 0.7, "random": 0.2})
    assert {m: r.metric_value for m, r in heads.items()} == pytest.approx(scores)
    assert {m: r.metric_args["se"] for m, r in heads.items()} == pytest.approx(
        {m: res["headline"][100][m]["se"] for m in methods})
    for m in methods:  # the card's table cell of the headline row says the same number
        assert f"{scores[m]:.3f} ± " in card.text


def test_a_task_without_probes_at_one_length_leaves_the_other_lengths_and_tasks_alone():
    """A (task, length) cell with no probes is skipped, not the rest: later lengths and tasks still get cells, and
    the headline says how many probes per task would bring its standard error to 0.03."""
    rows = _rows("a", 4, {"full": 4, "leank": 3}, length=200) + _rows("b", 10, {"full": 9, "leank": 9}, length=100)
    rows += _rows("b", 10, {"full": 8, "leank": 5}, length=200)
    s = summarize(rows, ["full", "leank"], [100, 200], ["a", "b"])
    assert set(s["tasks"]["a"]["full"]) == {200} and set(s["tasks"]["b"]["leank"]) == {100, 200}
    assert s["tasks"]["b"]["leank"][200]["correct"] == 5
    assert s["headline"][100]["tasks"] == ["b"] and s["headline"][200]["tasks"] == ["a", "b"]
    assert s["headline"][200]["probes_for_se_0.03"] == probes_for_se([1.0, 0.8]) > 0
    assert s["headline"][100]["probes_for_se_0.03"] == probes_for_se([0.9])
