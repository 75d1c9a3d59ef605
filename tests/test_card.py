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


def test_card_has_one_table_per_length_and_numbers_each_runs_command(tmp_path):
    """Rows of two runs (one per context length, another at one length too): one table per length, each row in its
    run's numbered `run` column, the commands listed in that order inside a folded <details> block."""
    from leank_infer.hub.card import write_model_card

    _mask_dir(tmp_path)
    results = [{"dataset": "niah 1024 tokens", "value": 0.91, "command": "eval --lengths 1024"},
               {"dataset": "niah 4096 tokens", "value": 0.42, "command": "eval --lengths 4096"},
               {"dataset": "passkey 1024 tokens", "value": 0.93, "command": "eval --lengths 1024"}]
    write_model_card(tmp_path, eval_results=results)
    text = (tmp_path / "README.md").read_text()
    body = text[text.index("## Results"):]
    one, four = body.index("### 1,024 tokens"), body.index("### 4,096 tokens")
    assert one < body.index("| 1 | niah | 0.910 |") < body.index("| 1 | passkey | 0.930 |") < four
    assert four < body.index("| 2 | niah | 0.420 |")
    folded = body[body.index("<details"):body.index("</details>")]
    assert folded.index("1. <code>eval --lengths 1024</code>") < folded.index("2. <code>eval --lengths 4096</code>")
    assert body.count("### ") == 2  # a length's rows are in its table only


def _suite_rows(command, length, n, leank_correct, methods=("full", "leank")):
    """The rows a suite run writes (card_results): one task and the headline, per method."""
    rows = []
    for m in methods:
        k = n if m == "full" else leank_correct
        args = {"method": m, "correct": k, "n": n, "wilson95": [0.5, 1.0]}
        head = {"method": m, "se": 0.01, "tasks": ["passkey"]}
        if m != "full":
            args["paired_vs_full"] = head["paired_vs_full"] = {"both": k, "only_full": n - k, "only_method": 0,
                                                               "neither": 0, "mcnemar_p": 0.5}
        common = {"dataset_type": "leank-ruler", "metric": f"accuracy ({m})", "metric_config": m, "command": command}
        rows.append({**common, "dataset": f"leank-ruler passkey, {length} tokens", "dataset_config": f"passkey-{length}",
                     "dataset_args": {"task": "passkey", "length": length}, "metric_args": args, "value": k / n})
        rows.append({**common, "dataset": f"leank-ruler headline, {length} tokens", "dataset_config": f"headline-{length}",
                     "dataset_args": {"task": "headline", "length": length, "tasks": ["passkey"]},
                     "metric_args": head, "value": k / n})
    return rows


def test_card_opens_with_its_headline_and_keeps_the_hub_metadata_short_and_valid(tmp_path):
    """The first line under the title is the mask's result (bytes kept; LeanK vs full per length, from the run with
    the most probes there); the metadata block is one line per result, holds each length's headline of that run
    only, and loads back through huggingface_hub as the very data build_card made."""
    from huggingface_hub import ModelCard

    from leank_infer.hub.card import build_card, write_model_card

    mask = _mask_dir(tmp_path)
    rows = (_suite_rows("run-small", 1024, 4, 3) + _suite_rows("run-big", 1024, 20, 18)
            + _suite_rows("run-big", 4096, 20, 10, methods=("full", "leank", "random")))
    write_model_card(tmp_path, eval_results=rows)
    text = (tmp_path / "README.md").read_text()
    head, meta_end = text.split("\n# LeanK mask for ", 1)[1].split("\n\n")[1], text.index("\n---\n", 4)
    b = mask.stats(dtype=torch.bfloat16)["bytes_per_token"]
    assert head.startswith(f"**{b['leank'] / b['dense']:.0%} of the dense KV bytes")
    assert "0.900 vs 1.000 at 1,024 tokens (-2/+0 probes), 0.500 vs 1.000 at 4,096 tokens" in head  # run-big at 1k
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.to_dict() == build_card(mask, str(tmp_path), rows).data.to_dict()
    results = card.data.to_dict()["model-index"][0]["results"]
    assert [r["dataset"]["config"] for r in results] == ["headline-1024", "headline-4096"]
    assert [m["value"] for m in results[0]["metrics"]] == [1.0, 0.9]  # run-big's, not run-small's 0.75
    assert {m["name"] for m in results[1]["metrics"]} == {"accuracy (full)", "accuracy (leank)", "accuracy (random)"}
    assert text[:meta_end].count("\n") < 12 + len(results)  # the fixed keys, then one line per result
    # every row still shows in the tables: run-small's too
    assert "| 1 | passkey | 4/4 | 3/4 (-1/+0) |" in text and "| 2 | **headline** | 1.000 ± 0.010 |" in text


def test_card_figures_have_captions_that_say_which_run_drew_them(tmp_path):
    """A figure of one of the card's runs names that run; one drawn by a run whose rows are not in the tables says
    its numbers are not comparable with them (the kinds and probes it used); each command sits in the caption."""
    from leank_infer.hub.card import write_model_card

    _mask_dir(tmp_path)
    rows = _suite_rows("leank eval m --lengths 1024 --json r.json", 1024, 4, 3)
    figures = {"acc.png": "leank eval m --kinds passkey multikey --samples 12 --plot acc.png",
               "same.png": "leank eval m --lengths 1024 --json r.json",
               "sweep.png": "python benchmarks/eval_masks.py m --from-json r.json --sweep-plot sweep.png"}
    write_model_card(tmp_path, eval_results=rows, figures=figures)
    text = (tmp_path / "README.md").read_text()
    caption = {name: text[text.index(f"**Figure** ({name})"):].split("\n\n")[0] for name in figures}
    assert "not one of the tables above, on the needle kinds passkey, multikey, 12 probes" in caption["acc.png"]
    assert "Drawn from run 1" in caption["same.png"]
    assert "Drawn from the saved results of runs 1 of the tables above" in caption["sweep.png"]
    assert f"<code>{figures['acc.png']}</code>" in text and f"<code>{figures['sweep.png']}</code>" in text
    assert "Left: each K channel's stage-1 learned scaler" in text  # pattern.png's caption


def test_card_recipe_is_folded_and_compact_yet_the_same_yaml(tmp_path):
    import yaml

    from leank_infer.hub.card import compact_recipe, write_model_card

    recipe = "out_dir: x\nstage1:\n  steps: 3\n  trainer: {}\nhaystacks:\n- essay\n- noise\nevaluate:\n  lengths:\n  - 1\n"
    assert yaml.safe_load(compact_recipe(recipe)) == yaml.safe_load(recipe)
    assert len(compact_recipe(recipe).splitlines()) == 4
    assert compact_recipe("not: [yaml") == "not: [yaml"  # not YAML: shown as given
    mask = _mask_dir(tmp_path)
    mask.recipe = recipe
    mask.save_pretrained(tmp_path)
    write_model_card(tmp_path)
    section = (tmp_path / "README.md").read_text().split("## Recipe", 1)[1]
    assert section.lstrip().startswith("<details") and "haystacks: [essay, noise]" in section


def test_leank_card_rewrites_a_card_from_the_folder_alone(tmp_path, capsys):
    """`leank card DIR` redraws README.md and pattern.png from the mask and eval.json, evaluating nothing; a folder
    that is not a mask is one usage error naming it."""
    import json

    from leank_infer.cli import main
    from leank_infer.hub.card import EVAL_FILE

    _mask_dir(tmp_path / "m")
    (tmp_path / "m" / EVAL_FILE).write_text(json.dumps({"results": _suite_rows("leank eval m", 1024, 4, 3)}))
    assert main(["card", str(tmp_path / "m")]) == 0
    text = (tmp_path / "m" / "README.md").read_text()
    assert "### 1,024 tokens" in text and "<code>leank eval m</code>" in text and (tmp_path / "m" / "pattern.png").is_file()
    assert main(["card", str(tmp_path / "nothing")]) == 2
    assert "nothing" in capsys.readouterr().err


def test_pattern_figure_labels_every_axis_and_colour_bar(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from leank_infer.hub.card import plot_pattern

    drawn = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), real(fig, *a, **k))[1])
    for mask in (_mask_dir(tmp_path / "scored"), ChannelMask.from_dir(tmp_path / "scored")):
        mask.scores = None if drawn else mask.scores  # the second: a mask without stage-1 scores (imported)
        plot_pattern(mask, tmp_path / "p.png")
    for fig in drawn:
        panels, bars = fig.axes[:2], fig.axes[2:]
        assert len(bars) == 2 and all(ax.get_xlabel() and ax.get_ylabel() and ax.get_title() for ax in panels)
        assert all(bar.get_ylabel() for bar in bars)


def test_committed_cards_are_what_leank_card_writes_now():
    """Each hub/*/README.md is the generator's output for its folder: a card edited by hand, or one not refreshed
    after a change of the generator or of eval.json, fails here (refresh: leank card hub/*)."""
    from pathlib import Path

    from leank_infer.hub.card import build_card, card_text, read_eval_record

    root = Path(__file__).resolve().parents[1]
    for folder in sorted(p for p in (root / "hub").iterdir() if (p / "config.json").is_file()):
        record = read_eval_record(folder)
        card = build_card(ChannelMask.from_dir(folder), f"hub/{folder.name}", record.get("results"),
                          record.get("figures"), record.get("kv_quant"))
        assert (folder / "README.md").read_text() == card_text(card), f"refresh with: leank card hub/{folder.name}"
        if (ChannelMask.from_dir(folder).extra or {}).get("training"):  # trained here: the embedded model's masks
            assert len(card_text(card).splitlines()) < 200, folder.name


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
    assert "every token between keeps 43.8% of its K channels" in text and "pruning starts past about 12 tokens" in text


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


def test_a_figure_keeps_its_command_in_its_metadata_not_in_its_pixels(tmp_path, monkeypatch):
    """The command that drew a result figure is in the PNG's Description (it travels with the file) and in no text
    drawn on the figure (a long command is unreadable at page size: the card's caption shows it)."""
    from matplotlib.figure import Figure
    from PIL import Image

    from leank_infer.hub.plots import plot_decode_time

    drawn = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), real(fig, *a, **k))[1])
    command = "leank bench hub/x --contexts 1024,2048 --new_tokens 8 --threads 2 --plot decode.png --card"
    rows = [{"batch": 1, "context": n, "dense_ms": 2.0 * n / 1024, "leank_ms": 1.5 * n / 1024} for n in (1024, 2048)]
    png = plot_decode_time(rows, tmp_path / "decode.png", command)
    assert Image.open(png).info["Description"] == command
    texts = [t.get_text() for t in drawn[0].findobj(lambda a: hasattr(a, "get_text"))]
    assert texts and not any("--threads" in t for t in texts)
