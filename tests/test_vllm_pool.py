"""How a vLLM worker lays out LeanK's pages (leank_infer.vllm.pool), and the one mask/model check: no vLLM needed."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from vllm_pages import random_mask

from leank_infer import ChannelMask, MaskError
from leank_infer.vllm.pool import WorkerPlan, kv_heads_of_rank, packed_width, steady_blocks
from leank_infer.vllm.settings import load_checked_mask, settings_from


def test_kv_heads_per_rank_split_or_replicate_as_vllm_does():
    assert [kv_heads_of_rank(8, 4, r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [kv_heads_of_rank(3, 3, r) for r in range(3)] == [[0], [1], [2]]
    assert [kv_heads_of_rank(2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]  # replicated
    with pytest.raises(MaskError, match="split"):
        kv_heads_of_rank(3, 2, 0)


def test_packed_rows_hold_every_layer_side_by_side():
    mask = random_mask(4, 3, 64, [16, 0, 48])
    plan = WorkerPlan.build(mask, [0, 1, 2, 3])
    widths = [packed_width(mask.keep[layer]) for layer in range(4)]
    assert [plan.slots[i].packed_offset for i in range(4)] == [sum(widths[:i]) for i in range(4)]
    assert plan.packed_row == sum(widths)
    # window stores: each layer's rest row (what its packed row lacks of K and V), side by side, layers in order,
    # a new store where the next one would not fit in a page of window_block tokens; every layer in exactly one
    full = 2 * 3 * 64
    rest = [full - w for w in widths]
    assert [plan.slots[i].window_width for i in range(4)] == rest
    assert [i for store in plan.window_layers for i in store] == [0, 1, 2, 3]
    assert plan.page_elements == plan.block_size * plan.packed_row  # the packed page: nothing wider
    capacity = plan.page_elements // plan.window_block
    for store in plan.window_layers:
        assert sum(rest[i] for i in store) <= plan.window_row <= capacity
        assert [plan.slots[i].window_offset for i in store] == [sum(rest[j] for j in store[:k]) for k in range(len(store))]
    for a, b in zip(plan.window_layers, plan.window_layers[1:], strict=False):
        assert sum(rest[i] for i in a) + rest[b[0]] > capacity  # b's first did not fit in a


HUB = sorted(p.parent for p in (Path(__file__).resolve().parent.parent / "hub").glob("*/mask.safetensors"))


def _in_flight(plan: WorkerPlan) -> float:
    """Elements a prompt token in flight holds: its share of a packed page and of a page in every window store."""
    return plan.page_elements / plan.block_size + len(plan.window_layers) * plan.page_elements / plan.window_block


@pytest.mark.parametrize("align", [None, 128, 256], ids=["hits-at-16", "hits-at-128", "hits-at-256"])
@pytest.mark.parametrize("folder", HUB, ids=[p.name for p in HUB])
def test_block_sizes_that_fill_the_pages_cost_nothing_else(folder, align):
    """Every mask in hub/: block sizes picked to fill the pages hold a prompt token in flight in no more elements than
    16-token pages, and cost nothing else: the packed page holds its block of packed rows, a decoding request holds no
    more window bytes than window pages of the packed block's size, prefix-cache hits align to at most ``align``
    tokens (16 with the packed block fixed, the default of an explicit ``--block-size 16``; 128, plain vLLM's CPU
    block, the CPU default) and prompts hash at 4 tokens or more. With 128 or more every mask's prompt token in
    flight is within 7% of a plain one."""
    mask = ChannelMask.from_pretrained(folder)
    layers = list(range(mask.num_layers))
    fit = WorkerPlan.build(mask, layers, dense_prompt=True, prefix_align=align, fit_packed=align is not None)
    same = WorkerPlan.build(mask, layers, dense_prompt=True, fit_window=False)
    own = WorkerPlan.build(mask, layers, dense_prompt=True, fit_window=False, block_size=fit.block_size)
    dense = 2 * mask.num_kv_heads * mask.head_dim * mask.num_layers
    assert _in_flight(fit) <= _in_flight(same) and (align is None or _in_flight(fit) <= 1.07 * dense)
    assert fit.page_elements == fit.block_size * fit.packed_row and same.block_size == 16
    assert fit.block_size == 16 or (align is not None and fit.block_size % 8 == 0 and 16 <= fit.block_size <= align)
    assert math.lcm(fit.block_size, fit.window_block) <= (align or 16)
    assert fit.window_block == fit.block_size or math.gcd(fit.block_size, fit.window_block) >= 4
    held = [len(p.window_layers) * steady_blocks(p.sink, p.window, p.window_block) * p.page_elements for p in (fit, own)]
    assert held[0] <= held[1]
    assert fit.window_block * fit.window_row <= fit.block_size * fit.packed_row  # every store's rows fit a packed page


def test_the_third_stage_mask_fills_its_pages_with_40_and_24_token_blocks():
    """What docs/vllm.md tells: the 0.7 third-stage mask's rest row is 1.6x its packed row. In 16-token window pages
    it takes two stores, the second partly empty; with the packed block fixed at 16 (hits at 16 tokens) one store of
    8-token pages, as many bytes per prompt token in flight (1.13x a plain token) and fewer a decoding request holds;
    by default on CPU (hits at up to 128 tokens, as plain vLLM's) packed pages of 40 tokens and one store of 24-token
    window pages (hits at 120, prompts hashed at 8), 1.01x. Under the positional rule no prompt holds its rest rows,
    and the 16 and 8 that a decoding request holds least in stay."""
    mask = ChannelMask.from_pretrained(Path(__file__).resolve().parent.parent / "hub" / "smollm2-135m-instruct-s3")
    layers = list(range(30))
    same, fixed, fit, positional = (
        WorkerPlan.build(mask, layers, dense_prompt=d, fit_window=f, prefix_align=a, fit_packed=a is not None)
        for f, a, d in ((False, None, True), (True, None, True), (True, 128, True), (True, 128, False))
    )
    got = [(p.block_size, p.window_block, len(p.window_layers)) for p in (same, fixed, fit, positional)]
    assert got == [(16, 16, 2), (16, 8, 1), (40, 24, 1), (16, 8, 1)]
    dense = 2 * 3 * 64 * 30
    assert [round(_in_flight(p) / dense, 2) for p in (same, fixed, fit)] == [1.13, 1.13, 1.01]
    assert [steady_blocks(16, 80, p.window_block) * len(p.window_layers) for p in (same, fixed, fit)] == [26, 24, 11]
    held = [steady_blocks(16, 80, p.window_block) * len(p.window_layers) * p.page_elements for p in (fit, positional)]
    assert held[1] < held[0] and _in_flight(fit) < _in_flight(positional)


def test_of_equal_fits_the_one_a_decoding_request_holds_least_in_is_taken():
    """``-r80``'s rest rows, 2.8x its packed row, fill one window store alike at (24, 8) and (48, 16) tokens: a prompt
    token in flight costs the same. The first is taken: its decoding requests hold fewer window bytes, and its hits
    align to 24 tokens rather than 48."""
    mask = ChannelMask.from_pretrained(Path(__file__).resolve().parent.parent / "hub" / "smollm2-135m-instruct-r80")
    layers = list(range(30))
    fit = WorkerPlan.build(mask, layers, dense_prompt=True, prefix_align=128, fit_packed=True)
    other = WorkerPlan.build(mask, layers, dense_prompt=True, prefix_align=48, block_size=48)
    assert [(p.block_size, p.window_block, len(p.window_layers)) for p in (fit, other)] == [(24, 8, 1), (48, 16, 1)]
    assert _in_flight(fit) == _in_flight(other)
    held = [steady_blocks(p.sink, p.window, p.window_block) * p.page_elements for p in (fit, other)]
    assert held[0] < held[1]


def test_window_pages_never_cost_a_decoding_request_more_than_pages_of_the_packed_block():
    """Rest rows whose tightest fit in flight (window pages of 32 tokens, several stores) would make a decoding
    request hold more window bytes (its sink and two windows, rounded up to blocks) than window pages of the packed
    block's 16 tokens: that pair is not taken, one that costs the request no more is."""
    from leank_infer.vllm.pool import fit_blocks, split_stores

    rests = [[55, 11, 48, 29, 34]]

    def held(w: int) -> int:
        return len(split_stores(rests[0], 16 * 131 // w)) * steady_blocks(32, 48, w) * 16 * 131

    assert held(32) > held(16)
    b, w, capacity = fit_blocks(131, rests, [16], 32, 48, 64)
    assert b == 16 and capacity == 16 * 131 // w and held(w) <= held(16)


def test_packed_and_rest_rows_are_the_full_rows_each_element_once():
    from leank_infer.vllm.layout import PackedLayout

    keep = torch.zeros(3, 8, dtype=torch.bool)
    keep[0, [1, 4, 6]] = True
    keep[2] = True
    layout = PackedLayout.from_keep(keep)
    k, v = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    rows, rest = layout.pack(k, v), layout.pack_rest(k, v)
    assert rows.shape[1] + rest.shape[1] == 2 * 3 * 8 == layout.width + layout.rest_width
    full = torch.cat([rows, rest], 1).index_select(1, layout.full_columns)
    assert torch.equal(full, torch.cat([k.reshape(5, -1), v.reshape(5, -1)], 1))
    assert set(layout.k_index.tolist()).isdisjoint(layout.kr_index.tolist())
    assert layout.vr_index.tolist() == list(range(8, 16))  # the V of head 1, the one keeping nothing


def test_every_tensor_parallel_rank_keeps_its_heads_and_has_the_same_pages():
    mask = random_mask(6, 3, 64, [64, 0, 16])
    plans = [WorkerPlan.build(mask, list(range(6)), 3, r) for r in range(3)]
    for r, plan in enumerate(plans):
        for layer in range(6):
            want = mask.keep[layer][r : r + 1]
            assert torch.equal(plan.slots[layer].layout.k_index, torch.nonzero(want.reshape(-1)).flatten())
            assert plan.slots[layer].packed_width == max(1, packed_width(want))
        assert plan.num_kv_heads == 1
    # the row is the widest rank's, the window cut the same everywhere: one page size for the engine
    rows = [sum(max(1, packed_width(mask.keep[layer][r : r + 1])) for layer in range(6)) for r in range(3)]
    assert {p.packed_row for p in plans} == {max(rows)}
    assert len({(p.window_row, p.window_layers, p.page_elements) for p in plans}) == 1
    # every rank's rest row fits its layer's share of the store, which is the widest rank's rest row
    for layer in range(6):
        widths = {p.slots[layer].window_width for p in plans}
        assert widths == {2 * 64 - min(packed_width(mask.keep[layer][r : r + 1]) for r in range(3))}
        assert all(p.slots[layer].layout.rest_width <= p.slots[layer].window_width for p in plans)


def test_pipeline_stages_share_one_page_size():
    mask = random_mask(8, 3, 64, [64, 64, 16, 0])
    stages = [[0, 1, 2, 3], [4, 5, 6, 7]]
    plans = [WorkerPlan.build(mask, stage, stages=stages) for stage in stages]
    assert plans[0].packed_row == plans[1].packed_row == max(
        sum(packed_width(mask.keep[layer]) for layer in stage) for stage in stages
    )
    assert set(plans[1].slots) == {4, 5, 6, 7} and plans[1].slots[4].packed_offset == 0
    assert plans[0].page_elements == plans[1].page_elements


@pytest.mark.parametrize("fit", [True, False])
def test_a_rest_row_wider_than_a_packed_row_fits_every_stages_page(fit):
    """A stage whose layers keep almost nothing has rest rows wider than the widest stage's packed row. With window
    blocks of their own (``fit``) the window pages hold fewer tokens and the page stays a packed one; with the packed
    block every stage's page grows to the rest row (vLLM's pool has one page size). A layer keeping everything (no rest
    row) gets a column inside the page."""
    mask = random_mask(5, 3, 64, [64])
    mask.keep[:] = False
    mask.keep[:2, :2, 0] = True  # stage 0: one channel in heads 0 and 1: packed 130, rest 254 a layer
    mask.keep[2:4, 0, 0] = True  # stage 1: one channel in head 0: packed 65, rest 319 > the packed row (260)
    mask.keep[4] = True  # and a layer keeping everything: no rest row
    stages = [[0, 1], [2, 3, 4]]
    plans = [WorkerPlan.build(mask, stage, stages=stages, fit_window=fit) for stage in stages]
    assert plans[0].packed_row == plans[1].packed_row == 65 + 65 + 384
    mask.keep[4] = False
    mask.keep[4, 0, 0] = True
    plans = [WorkerPlan.build(mask, stage, stages=stages, fit_window=fit) for stage in stages]
    assert plans[0].packed_row == 260 and plans[1].slots[2].window_width == 319
    assert len({(p.page_elements, p.window_block) for p in plans}) == 1
    if fit:
        assert plans[0].page_elements == 16 * 260 and plans[0].window_block < 16
        assert all(p.window_block * p.window_row <= 16 * 260 for p in plans)  # within the packed page
        assert plans[1].window_row >= 319
    else:
        assert plans[0].window_row == plans[1].window_row == 319 > plans[0].packed_row
        assert plans[0].page_elements == 16 * 319
    mask.keep[4] = True  # the last layer keeps everything again: its empty rest row's column stays in the page
    plans = [WorkerPlan.build(mask, stage, stages=stages, fit_window=fit) for stage in stages]
    for plan in plans:
        for slot in plan.slots.values():
            assert slot.window_offset + max(1, slot.window_width) <= plan.window_row
    # pages of one token: a stage's rest row (384, keeping nothing) is wider than a packed page (130) and wider than the
    # other stage's (319): both stages' pages are the widest rest row
    mask = random_mask(4, 3, 64, [64])
    mask.keep[:] = False
    mask.keep[2:, 0, 0] = True
    stages = [[0, 1], [2, 3]]
    plans = [WorkerPlan.build(mask, stage, block_size=1, stages=stages, fit_window=fit) for stage in stages]
    assert plans[0].packed_row == 130 and {p.page_elements for p in plans} == {384}


def test_a_mask_that_fits_the_shape_but_not_the_model_is_refused_in_vllm_as_in_transformers(tmp_path):
    """One check for both paths (mask.fit.check_fit): the base-model id, an adapter, config overrides."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    cfg._name_or_path = "org/x"
    base = dict(sink_size=16, recent_size=64, accumu_size=16, base_model="org/x")
    keep = torch.ones(30, 3, 64, dtype=torch.bool)
    cases = {
        "named": ChannelMask(keep, **{**base, "base_model": "org/other"}),
        "adapter": ChannelMask(keep, adapter="org/lora", **base),
        "yarn": ChannelMask(keep, config_overrides={"rope_parameters": {"rope_type": "yarn"}}, **base),
    }
    words = {"named": "trained for 'org/other'", "adapter": "PEFT adapter 'org/lora'", "yarn": "rope_parameters"}
    for name, mask in cases.items():
        mask.save_pretrained(tmp_path / name)
        with pytest.raises(MaskError, match=words[name]):
            load_checked_mask(settings_from({"leank_mask": str(tmp_path / name)}), cfg)
        with pytest.warns(UserWarning, match=words[name]):
            load_checked_mask(settings_from({"leank_mask": str(tmp_path / name), "leank_check_base_model": False}), cfg)
    ChannelMask(keep, **base).save_pretrained(tmp_path / "fits")
    assert load_checked_mask(settings_from({"leank_mask": str(tmp_path / "fits")}), cfg).num_layers == 30


def test_the_served_rule_is_dense_prompt_unless_named_and_an_unknown_one_is_refused():
    """``leank_rule``: dense-prompt by default (its plan keeps prompt rows), positional when named, and one error
    naming the two for anything else (dense-prefill cannot be served: it depends on how a prompt is scheduled)."""
    assert settings_from({"leank_mask": "m"}).rule == "dense-prompt" and settings_from({"leank_mask": "m"}).dense_prompt
    positional = settings_from({"leank_mask": "m", "leank_rule": "positional"})
    assert positional.rule == "positional" and not positional.dense_prompt
    with pytest.raises(MaskError, match=r"leank_rule'\] must be one of \['dense-prompt', 'positional'\], got 'dense-prefill'"):
        settings_from({"leank_mask": "m", "leank_rule": "dense-prefill"})
    mask = ChannelMask(torch.ones(2, 3, 64, dtype=torch.bool), sink_size=16, recent_size=64, accumu_size=16)
    assert WorkerPlan.build(mask, [0, 1], dense_prompt=True).dense_prompt
    assert not WorkerPlan.build(mask, [0, 1]).dense_prompt


def test_the_prefix_alignment_setting_is_a_whole_number_of_tokens():
    """``leank_prefix_align``: unset by default (hits at the packed block), a positive whole number when given, one
    error naming it for anything else."""
    assert settings_from({"leank_mask": "m"}).prefix_align is None
    assert settings_from({"leank_mask": "m", "leank_prefix_align": 256}).prefix_align == 256
    for bad in (0, -16, 2.5, "256", True):
        with pytest.raises(MaskError, match=r"leank_prefix_align'\] must be a whole number of tokens"):
            settings_from({"leank_mask": "m", "leank_prefix_align": bad})


def test_a_mask_keeping_every_channel_never_widens_the_page():
    """No rest rows (every channel kept): a window store still has a one-column row per token, so its block holds no
    more tokens than a packed page has elements, whatever prefix alignment is allowed; the page stays a packed one."""
    mask = ChannelMask(torch.ones(1, 1, 2, dtype=torch.bool), sink_size=4, recent_size=8, accumu_size=4, align=2)
    plan = WorkerPlan.build(mask, [0], prefix_align=256)
    assert plan.packed_row == 4 and plan.page_elements == 16 * 4
    assert plan.window_block * max(1, plan.window_row) <= plan.page_elements
