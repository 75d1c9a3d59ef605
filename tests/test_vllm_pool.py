"""How a vLLM worker lays out LeanK's pages (leank_infer.vllm.pool), and the one mask/model check: no vLLM needed."""

from __future__ import annotations

import pytest
import torch
from vllm_pages import random_mask

from leank_infer import ChannelMask, MaskError
from leank_infer.vllm.pool import WorkerPlan, kv_heads_of_rank, packed_width
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
    # a new store where the next one would not fit in a packed row; every layer in exactly one
    full = 2 * 3 * 64
    rest = [full - w for w in widths]
    assert [plan.slots[i].window_width for i in range(4)] == rest
    assert [i for store in plan.window_layers for i in store] == [0, 1, 2, 3]
    for store in plan.window_layers:
        assert sum(rest[i] for i in store) <= plan.window_row <= max(plan.packed_row, max(rest))
        assert [plan.slots[i].window_offset for i in store] == [sum(rest[j] for j in store[:k]) for k in range(len(store))]
    for a, b in zip(plan.window_layers, plan.window_layers[1:], strict=False):
        assert sum(rest[i] for i in a) + rest[b[0]] > max(plan.packed_row, max(rest))  # b's first did not fit in a
    assert plan.page_elements == plan.block_size * max(plan.packed_row, plan.window_row)


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


def test_a_rest_row_wider_than_a_packed_row_widens_every_stages_page():
    """A stage whose layers keep almost nothing has rest rows wider than the widest stage's packed row: every stage's
    page grows to it (vLLM's pool has one page size), and a layer keeping everything (no rest row) gets a column
    inside the page."""
    mask = random_mask(5, 3, 64, [64])
    mask.keep[:] = False
    mask.keep[:2, :2, 0] = True  # stage 0: one channel in heads 0 and 1: packed 130, rest 254 a layer
    mask.keep[2:4, 0, 0] = True  # stage 1: one channel in head 0: packed 65, rest 319 > the packed row (260)
    mask.keep[4] = True  # and a layer keeping everything: no rest row
    stages = [[0, 1], [2, 3, 4]]
    plans = [WorkerPlan.build(mask, stage, stages=stages) for stage in stages]
    assert plans[0].packed_row == plans[1].packed_row == 65 + 65 + 384
    mask.keep[4] = False
    mask.keep[4, 0, 0] = True
    plans = [WorkerPlan.build(mask, stage, stages=stages) for stage in stages]
    assert plans[0].packed_row == 260 and plans[1].slots[2].window_width == 319
    assert len({p.page_elements for p in plans}) == 1
    assert plans[0].window_row == plans[1].window_row == 319 > plans[0].packed_row
    mask.keep[4] = True  # the last layer keeps everything again: its empty rest row's column stays in the page
    plans = [WorkerPlan.build(mask, stage, stages=stages) for stage in stages]
    for plan in plans:
        for slot in plan.slots.values():
            assert slot.window_offset + max(1, slot.window_width) <= plan.window_row


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
