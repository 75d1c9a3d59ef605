"""benchmarks/eval_masks.py on a tiny model: one pass over several masks, and cards written from its saved JSON
equal the cards the run itself writes (same rows, the measuring command beside them)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import load_benchmark
from test_model import tiny_repo

from leank_infer import ChannelMask
from leank_infer.hub.card import EVAL_FILE


@pytest.fixture(scope="module")
def eval_masks():
    return load_benchmark("eval_masks")


def test_cards_from_the_saved_json_equal_the_runs_own(eval_masks, tmp_path, capsys):
    mask_dir, _ = tiny_repo(tmp_path)
    first = ChannelMask.from_dir(mask_dir)
    other_dir = tmp_path / "other"
    shutil.copytree(mask_dir, other_dir)
    scores = torch.rand(first.keep.shape, generator=torch.Generator().manual_seed(5))
    ChannelMask.from_scores(scores, 0.5, 4, sink_size=4, recent_size=8, accumu_size=4,
                            base_model=first.base_model).save_pretrained(other_dir)
    out = tmp_path / "run.json"
    args = [str(mask_dir), str(other_dir), "--lengths", "300", "--samples", "2", "--tasks", "passkey",
            "--threads", "1", "--seed", "0"]
    eval_masks.main([*args, "--json", str(out), "--card"])
    run = json.loads(out.read_text())
    assert run["methods"] == ["full", "leank-r50", "random-r50", "think-r50", "leank-r50-2", "random-r50-2",
                              "think-r50-2"]  # two masks of one ratio, named apart
    cards = {d: json.loads((d / EVAL_FILE).read_text()) for d in (mask_dir, other_dir)}
    for d in cards:
        (d / EVAL_FILE).unlink()
    eval_masks.main([*args, "--from-json", str(out), "--card"])
    for d, card in cards.items():
        assert json.loads((d / EVAL_FILE).read_text()) == card
        assert run["command"] in (d / "README.md").read_text()
    assert json.loads(out.read_text()) == run  # --from-json reads, never rewrites
    # a mask the saved run did not answer with is refused, naming the run's
    stranger = tmp_path / "stranger"
    shutil.copytree(other_dir, stranger)
    ChannelMask.from_scores(torch.rand(first.keep.shape, generator=torch.Generator().manual_seed(6)), 0.5, 4,
                            sink_size=4, recent_size=8, accumu_size=4,
                            base_model=first.base_model).save_pretrained(stranger)
    with pytest.raises(SystemExit, match="answered with the masks"):
        eval_masks.main([str(mask_dir), str(stranger), "--from-json", str(out), "--card"])
    # a copy of a measured mask in another folder (a candidate published into hub/) gets that mask's rows
    copy = tmp_path / "published"
    shutil.copytree(other_dir, copy)
    (copy / EVAL_FILE).unlink()
    eval_masks.main([str(copy), "--from-json", str(out), "--card"])
    assert json.loads((copy / EVAL_FILE).read_text()) == cards[other_dir]
    # the run's masks in another order, or one of them, get their own rows (the run's names for them)
    eval_masks.main([str(other_dir), "--from-json", str(out), "--card"])
    assert json.loads((other_dir / EVAL_FILE).read_text()) == cards[other_dir]


def test_cards_and_the_sweep_from_runs_at_two_lengths(eval_masks, tmp_path, capsys):
    """Issue #34: one saved run per length, each with its own probes per task; the cards hold the rows of both,
    each next to its own command, and the sweep figure scores each mask at both lengths, from its own answers."""
    from leank_train.evaluation.report import renamed

    mask_dir, _ = tiny_repo(tmp_path)
    first = ChannelMask.from_dir(mask_dir)
    other_dir = tmp_path / "other"
    shutil.copytree(mask_dir, other_dir)
    scores = torch.rand(first.keep.shape, generator=torch.Generator().manual_seed(5))
    ChannelMask.from_scores(scores, 0.75, 4, sink_size=4, recent_size=8, accumu_size=4,
                            base_model=first.base_model).save_pretrained(other_dir)
    runs = {}
    for length, samples in ((300, 3), (400, 2)):
        runs[length] = tmp_path / f"run{length}.json"
        eval_masks.main([str(mask_dir), str(other_dir), "--lengths", str(length), "--samples", str(samples),
                         "--tasks", "passkey", "--threads", "1", "--seed", "0", "--no-baselines",
                         "--json", str(runs[length])])
    saved = {n: json.loads(f.read_text()) for n, f in runs.items()}
    png = tmp_path / "sweep.png"
    # the masks in the other order than the runs': each card still gets its own mask's rows
    eval_masks.main([str(other_dir), str(mask_dir), "--from-json", *map(str, runs.values()), "--card",
                     "--sweep-plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for folder, method in ((mask_dir, "leank-r50"), (other_dir, "leank-r75")):
        record = json.loads((folder / EVAL_FILE).read_text())
        for n, res in saved.items():
            mine = [r for r in record["results"] if r["dataset_args"]["length"] == n]
            assert {r["command"] for r in mine} == {res["command"]}
            cell = renamed(res, {"full": "full", method: "leank"})["tasks"]["passkey"]["leank"][n]
            got = next(r for r in mine if r["dataset_args"]["task"] == "passkey" and r["metric_config"] == "leank")
            assert (got["metric_args"]["correct"], got["metric_args"]["n"]) == (cell["correct"], cell["n"])
        assert "sweep.png" in record["figures"] and (folder / "sweep.png").is_file()
        text = (folder / "README.md").read_text()
        assert all(res["command"] in text for res in saved.values())


def test_tasks_take_variants_the_run_names_them_by(eval_masks, tmp_path, monkeypatch):
    """Issue #34: at 4k-8k the suite answers variants of its tasks (``passkey:haystacks=filler``), named in the
    saved run and its cards as ``passkey[haystacks=filler]``; an unknown parameter stops the run."""
    from leank_train.evaluation import tasks as suite

    monkeypatch.setattr(suite, "TASKS", dict(suite.TASKS))  # the variant stays in this test
    mask_dir, _ = tiny_repo(tmp_path)
    out = tmp_path / "run.json"
    eval_masks.main([str(mask_dir), "--lengths", "300", "--samples", "2", "--tasks", "passkey:haystacks=filler",
                     "--threads", "1", "--seed", "0", "--no-baselines", "--json", str(out), "--card"])
    run = json.loads(out.read_text())
    assert list(run["tasks"]) == ["passkey[haystacks=filler]"]
    assert {a["haystack"] for a in run["answers"]} == {"filler"}
    assert "passkey[haystacks=filler]" in (mask_dir / "README.md").read_text()
    with pytest.raises(SystemExit, match="no parameter 'depth'"):
        eval_masks.main([str(mask_dir), "--lengths", "300", "--tasks", "passkey:depth=2", "--no-baselines"])


def test_card_add_keeps_the_rows_of_other_commands(eval_masks, tmp_path, capsys):
    """A run added to a card (--card --card-add: a new length) keeps the rows other commands measured; adding the
    same run again replaces its own rows instead of doubling them; plain --card replaces every row."""
    mask_dir, _ = tiny_repo(tmp_path)
    common = [str(mask_dir), "--tasks", "passkey", "--threads", "1", "--seed", "0", "--no-baselines"]
    eval_masks.main([*common, "--lengths", "300", "--samples", "2", "--card"])
    first = json.loads((mask_dir / EVAL_FILE).read_text())["results"]
    assert {r["dataset_args"]["length"] for r in first} == {300}
    out = tmp_path / "run400.json"
    eval_masks.main([*common, "--lengths", "400", "--samples", "2", "--json", str(out)])
    for _ in range(2):
        eval_masks.main([str(mask_dir), "--from-json", str(out), "--card", "--card-add"])
        rows = json.loads((mask_dir / EVAL_FILE).read_text())["results"]
        assert rows[: len(first)] == first
        assert len(rows) == 2 * len(first) and {r["dataset_args"]["length"] for r in rows[len(first):]} == {400}
    text = (mask_dir / "README.md").read_text()
    assert first[0]["command"] in text and json.loads(out.read_text())["command"] in text
    eval_masks.main([str(mask_dir), "--from-json", str(out), "--card"])
    assert {r["dataset_args"]["length"] for r in json.loads((mask_dir / EVAL_FILE).read_text())["results"]} == {400}
    with pytest.raises(SystemExit):
        eval_masks.main([str(mask_dir), "--from-json", str(out), "--card-add"])
