"""The LeanK rule's small pieces on their own (leank_infer/rule.py), against values worked out by hand or
from docs/rule.md ("Exact boundaries", "The rules"); the decode and training tests exercise them only through their callers.
Each rule's one-line description is written once (``RULE_DESCRIPTIONS``): every help text, docstring and docs table
that describes the rules quotes it, which the last tests hold."""

import inspect
import math
import re
from pathlib import Path

import pytest
import torch

from leank_infer.decode.rule import (
    DEFAULT_RULE,
    RETIRED_RULES,
    RULE_DESCRIPTIONS,
    RULES,
    RuleError,
    apply_softcap,
    check_rule,
    default_scale,
    gqa_view,
    key_regions,
    positional_compressible,
    row_recent_from,
    rules_help,
)

ROOT = Path(__file__).resolve().parents[1]


def test_default_scale_is_the_models_else_one_over_sqrt_head_dim():
    assert default_scale(64) == 0.125 and default_scale(128) == pytest.approx(1 / math.sqrt(128))
    assert default_scale(64, 0.3) == 0.3
    one = default_scale(64, 1)
    assert one == 1.0 and isinstance(one, float)


@pytest.mark.parametrize("grad", [False, True])
def test_softcap_is_cap_times_tanh_of_logit_over_cap(grad):
    logits = torch.tensor([-120.0, -3.0, 0.0, 0.5, 49.0, 300.0])
    expected = 50.0 * torch.tanh(logits / 50.0)
    scores = logits.clone().requires_grad_(grad)
    out = apply_softcap(scores, 50.0)
    torch.testing.assert_close(out, expected)
    assert out.abs().max() < 50.0
    if not grad:  # in place when autograd does not need the scores
        assert out.data_ptr() == scores.data_ptr()
    assert apply_softcap(logits, None) is logits


def test_gqa_view_groups_query_heads_by_kv_head_and_names_a_bad_split():
    q = torch.arange(6).float().reshape(1, 6, 1, 1).expand(1, 6, 1, 2)
    v = gqa_view(q, 2)
    assert v.shape == (1, 2, 3, 1, 2)
    assert v[0, 1, :, 0, 0].tolist() == [3.0, 4.0, 5.0]  # query heads 3..5 use KV head 1
    with pytest.raises(ValueError, match="6 query heads are not a multiple of 4 KV heads"):
        gqa_view(q, 4)


def test_key_regions_by_hand():
    keys = torch.arange(10).view(1, 1, 10)
    visible, middle = key_regions(keys, torch.tensor(8).view(1, 1, 1), torch.tensor(1).view(1, 1, 1), 2, 6)
    # padding [0,1), sink [1,3), middle [3,6), recent [6,8], future (8,10)
    assert visible[0, 0].tolist() == [False] + [True] * 8 + [False]
    assert middle[0, 0].tolist() == [False] * 3 + [True] * 3 + [False] * 4


def test_row_recent_from_counts_positions_from_each_rows_start():
    # recent 8, accumu 4: the position p counted from the row's start, recent_from = 4 * floor((p - 8) / 4)
    pos = torch.tensor([[20], [20], [20]])
    starts = torch.tensor([[0], [3], [9]])
    # relative 20 -> 12; relative 17 -> 8 (+3 = 11); relative 11 -> 0 (+9 = 9)
    assert row_recent_from(pos, starts, 8, 4).flatten().tolist() == [12, 11, 9]
    # early positions: a recent part reaching before the row's start (nothing is middle yet)
    assert row_recent_from(torch.tensor(5), torch.tensor(2), 8, 4).item() == 2 - 8


def test_positional_compressible_is_the_lowest_rows_recent_from():
    """Keys below it are middle for every row's query at ``length`` (and later: recent_from never decreases)."""
    starts = torch.tensor([0, 3, 9])
    assert positional_compressible(20, starts, 8, 4) == 9
    assert positional_compressible(21, starts, 8, 4) == 11  # rows at 21, 18, 12: 12, 8 + 3, 4 + 9
    for length in range(40):
        got = positional_compressible(length, starts, 8, 4)
        for row_start in starts.tolist():
            p = length - row_start
            assert got <= row_start + 4 * ((p - 8) // 4)
        assert any(got == s + 4 * ((length - s - 8) // 4) for s in starts.tolist())


def test_check_rule_names_the_rules():
    assert RULES == ("dense-prompt", "positional") and DEFAULT_RULE == RULES[0]
    for rule in RULES:
        assert check_rule(rule) == rule
    with pytest.raises(RuleError, match="rule must be one of 'dense-prompt', 'positional', got 'dense'"):
        check_rule("dense")


def test_a_retired_rule_names_its_replacement_and_why():
    """One ValueError for the retired name, wherever it comes from: the replacement, what it does, and why."""
    with pytest.raises(ValueError, match=r"rule 'dense-prefill' is retired: use 'dense-prompt' \(the prompt attends "
                                         r"with every channel, each generated token by its position\); its decode "
                                         r"schedule was anchored at the prompt's end"):
        check_rule("dense-prefill")
    assert set(RETIRED_RULES) == {"dense-prefill"} and not set(RETIRED_RULES) & set(RULES)


def _said(text: str) -> str:
    return " ".join(text.split())


def _rule_texts() -> dict[str, str]:
    """Every place that describes the rules to a user: CLI help (the docstrings the parsers read), the docstrings
    the API reference renders, and docs/rule.md's table."""
    from leank_infer import LeanKModel
    from leank_infer.bench import bench
    from leank_infer.decode.cache import LeanKCache
    from leank_infer.generate_cli import generate
    from leank_train.distill.module import LeanKDistillation
    from leank_train.evaluate import eval_command
    from leank_train.recipe import Recipe

    docs = (ROOT / "docs" / "rule.md").read_text()
    table = docs[docs.index("## The rules"):]
    table = re.sub(r"\]\([^)]*\)", "]", table[: table.index("\n### The retired rule")])  # links' targets aside
    return {
        "leank bench --rule": inspect.getdoc(bench), "leank generate --rule": inspect.getdoc(generate),
        "leank eval --rule": inspect.getdoc(eval_command), "leank run --student_rule": inspect.getdoc(Recipe),
        "LeanKDistillation(student_rule)": inspect.getdoc(LeanKDistillation.__init__),
        "LeanKModel": inspect.getdoc(LeanKModel), "LeanKCache": inspect.getdoc(LeanKCache),
        "benchmarks/eval_masks.py --rules": rules_help(), "docs/rule.md": table,
    }


PLACES = ["leank bench --rule", "leank generate --rule", "leank eval --rule", "leank run --student_rule",
          "LeanKDistillation(student_rule)", "LeanKModel", "LeanKCache", "benchmarks/eval_masks.py --rules",
          "docs/rule.md"]


def test_the_places_are_all_checked():
    assert sorted(_rule_texts()) == sorted(PLACES)


@pytest.mark.parametrize("place", PLACES)
def test_every_place_that_describes_the_rules_quotes_the_one_description(place):
    """Each rule's description is written once, in ``RULE_DESCRIPTIONS``: a help text, an API docstring or the
    docs table that describes the rules says each word for word (so none can drift), names the default, and
    offers no retired rule."""
    text = _said(_rule_texts()[place])
    for rule, description in RULE_DESCRIPTIONS.items():
        assert rule in text, f"{place} does not name {rule}"
        assert _said(description) in text, f"{place} does not say, word for word: {rule}: {description}"
    assert "the default" in text
    for retired in RETIRED_RULES:
        assert retired not in text, f"{place} still offers the retired {retired}"


def test_the_cli_help_shows_the_description():
    """What a user reads: ``leank bench --help`` (jsonargparse over the docstring) carries the description."""
    from leank_infer.bench import bench
    from leank_infer.cli import command_parser

    text = _said(command_parser(bench, "leank bench").format_help())
    for description in RULE_DESCRIPTIONS.values():
        assert _said(description) in text


def test_the_retired_name_is_one_error_line_on_every_command(capsys):
    """``--rule``/``--student_rule dense-prefill``: exit 2 and one line naming the replacement, before anything loads
    (``leank run``'s recipe check, ``leank bench`` before its model)."""
    from leank_infer.cli import main
    from leank_train.distill.module import LeanKDistillation
    from leank_train.errors import RecipeError
    from leank_train.recipe_checks import student_rule_problem

    assert main(["bench", "--rule", "dense-prefill", "--contexts", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("leank bench: error: --rule: rule 'dense-prefill' is retired: use 'dense-prompt'")
    assert len(err.splitlines()) == 1
    assert student_rule_problem("dense-prompt") is None and student_rule_problem("positional") is None
    assert "use 'dense-prompt'" in student_rule_problem("dense-prefill")
    with pytest.raises(RecipeError, match="model.student_rule: rule 'dense-prefill' is retired: use 'dense-prompt'"):
        LeanKDistillation(student_rule="dense-prefill")
