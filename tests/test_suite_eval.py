"""`leank eval` / `leank run` on the suite: per-task results with paired counts, --quick, bad lengths named."""

from __future__ import annotations

import json

import pytest
from test_model import tiny_repo

from leank_infer import LeanKModel
from leank_infer.cli import main as leank
from leank_train.evaluate import QUICK, TASK_NAMES, EvalSettings, evaluate


def main(args: list[str]) -> int:
    return leank(["eval", *args])

TASKS = ["niah_single_number", "passkey"]


@pytest.mark.slow  # tiny model, but the haystacks and three methods: ~15-60 s on a busy 2-core machine
def test_suite_results_pair_every_method_with_the_full_model(tmp_path):
    mask_dir, _ = tiny_repo(tmp_path)
    lm = LeanKModel.from_pretrained(mask_dir)
    res = evaluate(lm, lengths=[300], samples=2, methods=["full", "leank", "random"], seed=0, kl=False,
                   tasks=TASKS)
    assert len(res["answers"]) == 4 and {r["kind"] for r in res["answers"]} == set(TASKS)
    for row in res["answers"]:
        assert set(row["correct"]) == {"full", "leank", "random"} and row["tokens"] <= 300
    for task in TASKS:
        full = res["tasks"][task]["full"][300]
        assert full["n"] == 2 and "paired" not in full
        leank = res["tasks"][task]["leank"][300]
        p = leank["paired"]
        assert p["both"] + p["only_full"] + p["only_method"] + p["neither"] == 2
        assert p["both"] + p["only_full"] == full["correct"] and p["both"] + p["only_method"] == leank["correct"]
        assert leank["wilson95"][0] <= leank["accuracy"] <= leank["wilson95"][1]
    h = res["headline"][300]
    assert set(h["tasks"]) <= set(TASKS)
    assert all(res["tasks"][t]["full"][300]["accuracy"] >= 0.8 for t in h["tasks"])


def test_eval_cli_quick_json_and_errors(tmp_path, capsys, monkeypatch):
    import leank_train.evaluate as ev

    mask_dir, _ = tiny_repo(tmp_path)
    seen = {}
    real = ev.evaluate

    def spy(lm, lengths, samples, *args, **kwargs):
        seen.update(lengths=list(lengths), samples=samples, kl=kwargs["kl"], tasks=kwargs["tasks"])
        return real(lm, [300], 1, *args, **{**kwargs, "tasks": TASKS})

    monkeypatch.setattr(ev, "evaluate", spy)
    out = tmp_path / "r.json"
    assert main([str(mask_dir), "--quick", "--methods", "full", "leank", "--json", str(out)]) == 0
    assert seen == {"lengths": QUICK["lengths"], "samples": QUICK["samples"], "kl": False, "tasks": list(TASK_NAMES)}
    res = json.loads(out.read_text())
    assert res["command"].endswith("--quick --methods full leank --json " + str(out))
    assert set(res["tasks"]) == set(TASKS) and "paired" in res["tasks"]["passkey"]["leank"]["300"]
    assert "| passkey | leank |" in capsys.readouterr().out
    monkeypatch.setattr(ev, "evaluate", real)
    # a length no task fits in: one line naming it, exit 2
    assert main([str(mask_dir), "--lengths", "40", "--samples", "1", "--methods", "full", "--no-kl"]) == 2
    assert "too short for task" in capsys.readouterr().err
    assert main([str(mask_dir), "--tasks", "no_such_task"]) == 2


def test_settings_command_and_leank_run_quick(monkeypatch):
    s = EvalSettings(lengths=[1024, 2048], samples=20, methods=["full", "leank"], seed=3, kl=False)
    assert s.command("m") == "leank eval m --lengths 1024 2048 --samples 20 --methods full leank --seed 3 --no-kl"
    q = EvalSettings(quick=True, tasks=["passkey"])
    assert q.resolved().lengths == QUICK["lengths"] and q.resolved().samples == QUICK["samples"]
    assert q.command("m") == "leank eval m --quick --methods full leank random think --seed 1234 --tasks passkey"

    import leank_train.pipeline as pipeline

    got = {}
    monkeypatch.setattr(pipeline, "_run", lambda recipe, stages: got.update(recipe=recipe, stages=stages) or 0)
    from pathlib import Path

    recipe = str(Path(__file__).parent.parent / "recipes" / "smollm2-135m.yaml")
    assert leank(["run", recipe, "--quick", "--stage1.steps", "2"]) == 0
    assert got["recipe"].evaluate.quick and got["recipe"].stage1.steps == 2 and got["stages"] == (1, 2)


@pytest.mark.slow
def test_sweep_on_the_suite_pairs_each_mask_with_the_full_model(tmp_path):
    import torch

    from leank_infer import ChannelMask
    from leank_train.evaluate import card_results, ratio_sweep

    mask_dir, _ = tiny_repo(tmp_path)
    lm = LeanKModel.from_pretrained(mask_dir)
    other = ChannelMask.from_scores(torch.rand(lm.mask.keep.shape, generator=torch.Generator().manual_seed(5)),
                                    0.75, 4, sink_size=4, recent_size=8, accumu_size=4, base_model=lm.mask.base_model)
    res = ratio_sweep(lm, [("a", lm.mask), ("b", other)], [300], 2, seed=0, tasks=["passkey"])
    assert len(res["full_answers"]) == 2
    for row in res["masks"]:
        cell = row["tasks"]["passkey"]["leank"][300]
        assert cell["n"] == 2 and sum(cell["paired"][k] for k in ("both", "only_full", "only_method", "neither")) == 2
        h = row["headline"][300]
        if h["tasks"]:  # the mask's sweep accuracy is its headline score
            assert row["accuracy"][300] == h["leank"]["score"]
        else:
            assert row["accuracy"][300] != row["accuracy"][300]  # nan: no task to score on
        rows = card_results({**row, "methods": ["full", "leank"]}, "leank eval a b")
        assert {r["metric_config"] for r in rows} == {"full", "leank"}


def test_one_pass_pairs_several_masks_and_their_baselines_with_the_full_model(tmp_path):
    """Method objects: a second learned mask and a baseline at its budget answer the same probes under their own
    names, each paired with the full model; the second mask decodes as that mask alone would."""
    import torch

    from leank_infer import ChannelMask
    from leank_train.evaluation.methods import Full, Learned, RandomChannels

    mask_dir, _ = tiny_repo(tmp_path)
    lm = LeanKModel.from_pretrained(mask_dir)
    other = ChannelMask.from_scores(torch.rand(lm.mask.keep.shape, generator=torch.Generator().manual_seed(5)),
                                    0.75, 4, sink_size=4, recent_size=8, accumu_size=4, base_model=lm.mask.base_model)
    kw = dict(lengths=[48], samples=3, kinds=["passkey"], seed=0, kl=False, max_new_tokens=6,
              sentences=["w5 w6 w7 w8 w9 w10 w11 w12."] * 20)
    res = evaluate(lm, methods=[Full(), "leank", Learned("leank-b", other), RandomChannels("random-b", like=other)],
                   **kw)
    assert res["methods"] == ["full", "leank", "leank-b", "random-b"]
    alone = evaluate(LeanKModel(lm.model, other, lm.tokenizer), methods=["leank"], **kw)
    assert [r["leank-b"] for r in res["answers"]] == [r["leank"] for r in alone["answers"]]
    with pytest.raises(ValueError, match="share a name"):
        evaluate(lm, methods=["full", Full()], **kw)


def test_sweep_answers_each_mask_as_that_mask_alone_does(tmp_path):
    """A sweep is one pass (one prefill per probe): each mask's answers, under its own row, are the answers of a
    run of that mask alone, and the full model's are the full model's; two different masks answer differently."""
    import torch

    from leank_infer import ChannelMask
    from leank_train.evaluate import ratio_sweep

    mask_dir, _ = tiny_repo(tmp_path)
    lm = LeanKModel.from_pretrained(mask_dir)
    other = ChannelMask.from_scores(torch.rand(lm.mask.keep.shape, generator=torch.Generator().manual_seed(5)),
                                    0.75, 4, sink_size=4, recent_size=8, accumu_size=4, base_model=lm.mask.base_model)
    kw = dict(lengths=[48], samples=3, kinds=["passkey"], seed=0, sentences=["w5 w6 w7 w8 w9 w10 w11 w12."] * 20)
    res = ratio_sweep(lm, [("a", lm.mask), ("b", other)], **kw)
    assert [r["mask"] for r in res["masks"]] == ["a", "b"]
    for row, mask in zip(res["masks"], [lm.mask, other], strict=True):
        alone = evaluate(LeanKModel(lm.model, mask, lm.tokenizer), methods=["full", "leank"], kl=False,
                         max_new_tokens=24, **kw)
        assert [a["leank"] for a in row["answers"]] == [a["leank"] for a in alone["answers"]]
        assert row["accuracy"] == alone["accuracy"]["leank"] and res["full"] == alone["accuracy"]["full"]
    assert [a["leank"] for a in res["masks"][0]["answers"]] != [a["leank"] for a in res["masks"][1]["answers"]]
