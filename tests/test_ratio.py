"""Higher ratios: whole-head-favouring binarisation, the stage-2 ratio anneal, and the ratio sweep of `leank eval`."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from test_model import tiny_repo
from test_train_fit import _module, _trainer, datamodule  # noqa: F401  (the fixture)

from leank_infer import ChannelMask
from leank_infer.cli import main as leank
from leank_infer.mask import MaskError, binarize
from leank_train.export import ExportMask

pytestmark = pytest.mark.filterwarnings(r"ignore:Found \d+ module\(s\) in eval mode")


def _scores(seed: int = 0, shape=(6, 4, 32)) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) ** 3


@pytest.mark.parametrize("ratio", [0.5, 0.7, 0.8, 0.9])
@pytest.mark.parametrize("min_kept", [8, 16, 24])
def test_min_kept_makes_whole_heads_and_keeps_the_budget(ratio, min_kept):
    s = _scores()
    plain = binarize(s, ratio, 8)
    heads = binarize(s, ratio, 8, min_kept)
    counts = heads.sum(-1)
    assert ((counts == 0) | (counts >= min_kept)).all() and (counts % 8 == 0).all()
    assert (counts == 0).sum() >= (plain.sum(-1) == 0).sum()
    budget = (1 - ratio) * s.numel()
    # the nearest total the rule can reach: off by less than one head's worth of channels
    assert abs(int(heads.sum()) - budget) < s.shape[-1]
    # within a head, still its highest-scoring channels
    for layer, head in (counts > 0).nonzero().tolist():
        kept = s[layer, head][heads[layer, head]]
        dropped = s[layer, head][~heads[layer, head]]
        assert dropped.numel() == 0 or kept.min() >= dropped.max()


def test_min_kept_zero_is_the_plain_rule_and_bad_values_are_named():
    s = _scores(1)
    assert torch.equal(binarize(s, 0.7, 8, 0), binarize(s, 0.7, 8))
    with pytest.raises(MaskError, match="min_kept"):
        binarize(s, 0.7, 8, 33)


def test_stage2_anneals_the_ratio_and_exports_at_the_target(datamodule, tmp_path):  # noqa: F811
    scores = _scores(2, (2, 2, 16))
    ChannelMask.from_scores(scores, 0.5, 4, sink_size=4).save_pretrained(tmp_path / "s1")
    module = _module("llama", stage=2, init_scores=str(tmp_path / "s1"), lr=0.01, reg_weight=0.0, ratio=0.75,
                     ratio_start=0.25, ratio_anneal_steps=2, min_kept=8)
    _trainer(tmp_path, 3, [ExportMask(dirpath=str(tmp_path / "final"))]).fit(module, datamodule=datamodule)
    rows = list(csv.DictReader(open(next(tmp_path.glob("logs/version_0/metrics.csv")))))
    assert [float(r["train/ratio"]) for r in rows if r.get("train/ratio")] == [0.25, 0.5, 0.75]
    final = ChannelMask.from_dir(tmp_path / "final")
    assert final.ratio == 0.75
    assert torch.equal(final.keep, binarize(final.scores, 0.75, 4, 8))
    counts = final.kept_counts
    assert ((counts == 0) | (counts >= 8)).all()


def test_ratio_start_is_checked():
    from leank_train.distill.module import LeanKDistillation

    with pytest.raises(ValueError, match="ratio_start"):
        LeanKDistillation(stage=2, init_scores="x", ratio_start=1.5)


def test_eval_sweep_cli_table_plot_json_and_cards(tmp_path, capsys):
    mask_dir, _ = tiny_repo(tmp_path)
    base = ChannelMask.from_dir(mask_dir)
    other = ChannelMask.from_scores(torch.rand(base.keep.shape, generator=torch.Generator().manual_seed(5)), 0.75, 4,
                                    sink_size=4, recent_size=8, accumu_size=4, base_model=base.base_model)
    other_dir = other.save_pretrained(tmp_path / "mask75")
    from leank_infer.hub.card import write_model_card

    write_model_card(other_dir, [{"dataset": "earlier eval", "metric": "accuracy (think)", "value": 0.25}])
    plot, out = tmp_path / "sweep.png", tmp_path / "sweep.json"
    argv = [str(mask_dir), str(other_dir), "--lengths", "48", "--samples", "2", "--kinds", "passkey",
            "--seed", "0", "--plot", str(plot), "--json", str(out), "--card"]
    assert leank(["eval", *argv]) == 0
    res = json.loads(out.read_text())
    assert [r["ratio"] for r in res["masks"]] == [base.ratio, 0.75]
    by_ratio = {r["ratio"]: r for r in res["masks"]}
    assert by_ratio[0.75]["bytes_per_token"]["leank"] == other.kv_bytes_per_token(torch.bfloat16)["leank_middle"]
    assert set(res["full"]) == {"48"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for folder in (mask_dir, other_dir):
        card = (folder / "README.md").read_text()
        assert "![sweep.png](sweep.png)" in card and "leank eval " in card
        assert (folder / "sweep.png").is_file()
    # a card without results gets the sweep's rows; one with results keeps its own
    assert "accuracy (leank)" in (mask_dir / "README.md").read_text()
    other_card = (other_dir / "README.md").read_text()
    assert "accuracy (think)" in other_card and "accuracy (leank)" not in other_card
    table = capsys.readouterr().out
    assert "| full model |" in table and "0.75" in table


def test_eval_sweep_refuses_masks_of_another_model(tmp_path, capsys):
    mask_dir, _ = tiny_repo(tmp_path)
    other = ChannelMask.from_dir(mask_dir)
    other.base_model = "someone/else"
    other_dir = other.save_pretrained(tmp_path / "foreign")
    assert leank(["eval", str(mask_dir), str(other_dir), "--lengths", "48", "--samples", "1"]) == 2
    assert "one base model" in capsys.readouterr().err
    yarn = ChannelMask.from_dir(mask_dir)  # same base model, learned with YaRN: another model too
    yarn.config_overrides = {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}
    yarn_dir = yarn.save_pretrained(tmp_path / "yarn")
    assert leank(["eval", str(mask_dir), str(yarn_dir), "--lengths", "48", "--samples", "1"]) == 2
    assert "overrides" in capsys.readouterr().err

