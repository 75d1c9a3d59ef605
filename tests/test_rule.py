"""The LeanK rule's small pieces on their own (leank_infer/rule.py), against values worked out by hand or
from docs/rule.md ("Exact boundaries", "The decode schedule"); the decode and training tests exercise them only through their callers."""

import math

import pytest
import torch

from leank_infer.decode.rule import (
    apply_softcap,
    check_rule,
    decode_recent_from,
    default_scale,
    gqa_view,
    key_regions,
    positional_compressible,
    prefill_recent_from,
    recent_from,
    row_recent_from,
)


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


def test_prefill_recent_from_keeps_the_last_recent_size_tokens_full():
    assert prefill_recent_from(20, 8) == 12
    assert prefill_recent_from(8, 8) == 0
    assert prefill_recent_from(3, 8) == 0


def _schedule_by_loop(prefill: int, length: int, recent: int, accumu: int) -> int:
    """The decode schedule of docs/rule.md, token by token: while the full recent part holds more than
    recent + accumu keys, its oldest accumu keys go to the middle."""
    start = max(0, prefill - recent)
    for n in range(prefill, length + 1):  # before the token that makes the cache n + 1 long
        while n - start > recent + accumu:
            start += accumu
    return start


@pytest.mark.parametrize("recent,accumu", [(8, 4), (4, 1), (5, 3)])
def test_decode_schedule_closed_form_equals_the_loop(recent, accumu):
    for prefill in range(0, 30):
        for length in range(prefill, 60):
            got = recent_from(prefill, length, recent, accumu)
            assert got == _schedule_by_loop(prefill, length, recent, accumu), (prefill, length)
            # a query then sees between recent and recent + accumu full keys (fewer only while the cache is short)
            assert length - got <= recent + accumu
            assert length - got >= min(length, recent)


def test_decode_recent_from_by_hand():
    # 12 full keys = recent 8 + accumu 4: nothing moves yet; 13: the oldest 4 move to the middle
    assert decode_recent_from(0, 12, 8, 4) == 0
    assert decode_recent_from(0, 13, 8, 4) == 4
    assert decode_recent_from(4, 17, 8, 4) == 8
    # a prefill of 4 tokens (all recent): the first roll comes when the cache holds 13 tokens
    assert recent_from(4, 12, 8, 4) == 0 and recent_from(4, 13, 8, 4) == 4


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
    for rule in ("positional", "dense-prefill", "dense-prompt"):
        assert check_rule(rule) == rule
    with pytest.raises(ValueError, match="rule must be one of 'dense-prefill', 'positional', 'dense-prompt', got 'dense'"):
        check_rule("dense")
