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
    # masks other than the saved run's, or in another order, are refused, naming the run's
    for masks in ([other_dir, mask_dir], [mask_dir]):
        with pytest.raises(SystemExit, match="answered with the masks"):
            eval_masks.main([*map(str, masks), "--from-json", str(out), "--card"])
