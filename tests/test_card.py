"""Model cards: generated from the mask files, with the Hub metadata the issue asks for."""

from __future__ import annotations

import torch

from leank_infer import ChannelMask
from leank_infer.mask import MaskError


def _mask_dir(tmp_path, base="HuggingFaceTB/SmolLM2-135M-Instruct"):
    g = torch.Generator().manual_seed(0)
    mask = ChannelMask.from_scores(torch.rand(4, 3, 64, generator=g) ** 2, 0.7, 16, base_model=base,
                                   recipe="model: x\n", sink_size=16, recent_size=64, accumu_size=16)
    mask.save_pretrained(tmp_path)
    return mask


def test_card_metadata_and_body(tmp_path):
    from huggingface_hub import ModelCard

    from leank_infer.hub.card import write_model_card

    mask = _mask_dir(tmp_path)
    results = [{"dataset": "needle-2k", "value": 0.75, "command": "leank eval hub/x"}]
    write_model_card(tmp_path, eval_results=results)
    card = ModelCard.load(tmp_path / "README.md")
    d = card.data.to_dict()
    assert d["base_model"] == mask.base_model
    assert d["library_name"] == "leank"
    assert d["pipeline_tag"] == "text-generation"
    assert {"leank", "kv-cache", "pruning", "llama"} <= set(d["tags"])
    assert d["license"] == "apache-2.0"
    assert d["model-index"][0]["results"][0]["metrics"][0]["value"] == 0.75
    s = mask.stats(dtype=torch.bfloat16)
    assert f"{100 * s['k_kept_fraction']:.1f}%" in card.text
    assert f"{s['zero_heads']} of {s['total_heads']}" in card.text
    # the usage snippet loads the folder by the path the card was written for
    assert "model: x" in card.text and f'LeanKModel.from_pretrained("{tmp_path}")' in card.text
    assert (tmp_path / "pattern.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_card_puts_each_runs_rows_under_the_command_that_measured_them(tmp_path):
    """Rows of two runs (one per context length, issue #34): each table sits under its own command, and a row is
    shown under its run's command only."""
    from leank_infer.hub.card import write_model_card

    _mask_dir(tmp_path)
    results = [{"dataset": "niah 1024 tokens", "value": 0.91, "command": "eval --lengths 1024"},
               {"dataset": "niah 4096 tokens", "value": 0.42, "command": "eval --lengths 4096"},
               {"dataset": "niah 1024 tokens, again", "value": 0.93, "command": "eval --lengths 1024"}]
    write_model_card(tmp_path, eval_results=results)
    text = (tmp_path / "README.md").read_text()
    body = text[text.index("## Results"):]
    one, four = body.index("`eval --lengths 1024`"), body.index("`eval --lengths 4096`")
    assert one < body.index("0.910") < body.index("0.930") < four < body.index("0.420")


def test_card_without_results_or_known_license(tmp_path):
    from huggingface_hub import ModelCard

    from leank_infer.hub.card import write_model_card

    _mask_dir(tmp_path, base="someone/unknown-model")
    write_model_card(tmp_path, repo="someone/leank-mask")
    d = ModelCard.load(tmp_path / "README.md").data.to_dict()
    assert "license" not in d and "model-index" not in d
    assert "LeanKModel.from_pretrained(\"someone/leank-mask\")" in (tmp_path / "README.md").read_text()


def test_card_names_what_the_mask_was_learned_on(tmp_path):
    """Revision, PEFT adapter and config overrides (YaRN) appear in the card; a plain mask's card has no such list."""
    from leank_infer.hub.card import write_model_card

    _mask_dir(tmp_path / "plain")
    write_model_card(tmp_path / "plain")
    assert "Learned on" not in (tmp_path / "plain" / "README.md").read_text()
    g = torch.Generator().manual_seed(0)
    yarn = {"rope_type": "yarn", "factor": 4.0}
    ChannelMask.from_scores(
        torch.rand(4, 3, 64, generator=g), 0.7, 16, base_model="org/base", base_revision="b1",
        adapter="org/lora", adapter_revision="a2", config_overrides={"rope_parameters": yarn},
    ).save_pretrained(tmp_path / "tuned")  # fmt: skip
    write_model_card(tmp_path / "tuned")
    text = (tmp_path / "tuned" / "README.md").read_text()
    assert "Learned on" in text and "revision: `b1`" in text and "`org/lora` at `a2`" in text
    assert '`rope_parameters` = `{"rope_type": "yarn", "factor": 4.0}`' in text


def test_card_refuses_a_folder_without_mask(tmp_path):
    import pytest

    from leank_infer.hub.card import write_model_card

    with pytest.raises(MaskError, match="missing"):
        write_model_card(tmp_path)
    assert not (tmp_path / "README.md").exists()


def test_card_usage_snippet_runs_as_written(tmp_path, capsys):
    """The card's Python block, executed verbatim against a mask repo of a tiny model."""
    import re

    from test_model import tiny_repo

    from leank_infer.hub.card import write_model_card

    mask_dir, _ = tiny_repo(tmp_path)
    write_model_card(mask_dir, repo=str(mask_dir))
    text = (mask_dir / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert f'LeanKModel.from_pretrained("{mask_dir}")' in code
    exec(compile(code, "card-usage", "exec"), {})
    printed = capsys.readouterr().out.strip()
    assert printed  # the snippet decoded and printed an answer


def test_card_statistics_carry_the_numbers_worked_out_by_hand(tmp_path):
    """Issue #31: each row of the card's statistics table against its number, worked out once from the keep counts
    (not from mask.stats(), which the card itself uses)."""
    from leank_infer.hub.card import write_model_card

    keep = torch.zeros(2, 2, 16, dtype=torch.bool)
    keep[0, 1, :8] = True  # layer 0: a zero head and an 8-channel head
    keep[1, 0, :] = True  # layer 1: a whole head and a 4-channel head
    keep[1, 1, :4] = True
    ChannelMask(keep=keep, sink_size=5, recent_size=7, accumu_size=3, ratio=0.5, align=4,
                base_model="org/m").save_pretrained(tmp_path)
    write_model_card(tmp_path)
    text = (tmp_path / "README.md").read_text()
    # K: 28 of 64 channels; V: 3 of 4 heads; bf16 bytes per pruned token: K 28 x 2 + V 3 x 16 x 2 = 152 of 256
    for row in ("| K channels kept | 43.8% |", "| V kept (heads with >= 1 channel) | 75.0% |",
                "| heads with zero channels | 1 of 4 |", "| KV bytes / pruned token (bfloat16) | 152 vs 256 dense (0.594x) |",
                "| sink / recent / accumulation tokens | 5 / 7 / 3 |", "| ratio / align | 0.5 / 4 |"):
        assert row in text, row
    assert "keeps 43.8% of the K cache and\n75.0% of the V cache" in text


def test_card_says_the_rule_its_leank_rows_decoded_by(tmp_path):
    """A run under the positional or dense-prompt rule says so above its table, one under the retired dense-prefill
    rule says that it is retired and why its rows stand; rows without a rule (older runs) say nothing about it."""
    from leank_infer.hub.card import write_model_card

    _mask_dir(tmp_path)
    row = {"dataset": "needle-2k", "value": 0.9, "command": "python benchmarks/eval_masks.py x --rules positional",
           "metric": "accuracy (leank)", "metric_config": "leank", "metric_args": {"method": "leank"}}
    write_model_card(tmp_path, eval_results=[row])
    assert "Rule of the LeanK rows" not in (tmp_path / "README.md").read_text()
    write_model_card(tmp_path, eval_results=[{**row, "metric_args": {"method": "leank", "rule": "positional"}}])
    assert "Rule of the LeanK rows: positional (every query" in (tmp_path / "README.md").read_text()
    write_model_card(tmp_path, eval_results=[{**row, "metric_args": {"method": "leank", "rule": "dense-prompt"}}])
    assert "Rule of the LeanK rows: dense-prompt (the prompt attended densely" in (tmp_path / "README.md").read_text()
    # rows measured under the retired rule say so, and why they stand
    write_model_card(tmp_path, eval_results=[{**row, "metric_args": {"method": "leank", "rule": "dense-prefill"}}])
    said = " ".join((tmp_path / "README.md").read_text().split())
    assert ("Rule of the LeanK rows: dense-prefill (measured under the retired dense-prefill rule" in said
            and "the rows stand for dense-prompt, the default, which gave the same answers on the measured probes"
            in said)
