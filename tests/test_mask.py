"""The mask format: binarisation rule, save/load round trip, stats, and every bad input."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_config

from leank_infer import ChannelMask, MaskError
from leank_infer.mask import CONFIG_FILE, MASK_FILE, binarize


def random_mask(layers=2, heads=2, dim=16, ratio=0.5, align=4, seed=0, **meta) -> ChannelMask:
    g = torch.Generator().manual_seed(seed)
    return ChannelMask.from_scores(torch.rand(layers, heads, dim, generator=g), ratio, align, **meta)


@pytest.mark.parametrize("ratio,align", [(0.7, 16), (0.5, 8), (0.9, 32), (0.0, 64), (0.3, 1)])
def test_binarize_follows_the_rule(ratio, align):
    torch.manual_seed(1)
    scores = torch.rand(6, 3, 64) ** 3  # skewed, like trained scalers
    keep = binarize(scores, ratio, align)
    counts = keep.sum(-1)
    assert (counts % align == 0).all(), "every head keeps a multiple of align channels"
    # counts come from the global quantile, rounded per head
    threshold = torch.quantile(scores.flatten(), ratio)
    above = (scores > threshold).sum(-1).float()
    assert torch.equal(counts, (torch.floor(above / align + 0.5) * align).long())
    # each head keeps its highest-scoring channels
    for layer in range(6):
        for head in range(3):
            c = int(counts[layer, head])
            if 0 < c < 64:
                kept, dropped = scores[layer, head][keep[layer, head]], scores[layer, head][~keep[layer, head]]
                assert kept.min() >= dropped.max()
    # the kept fraction is close to 1 - ratio (align rounding moves it by at most align/2 per head)
    assert abs(keep.float().mean() - (1 - ratio)) <= align / 2 / 64 + 1e-6


def test_binarize_is_deterministic_on_ties():
    scores = torch.ones(2, 2, 16)
    scores[..., :4] = 2.0
    a, b = binarize(scores, 0.5, 4), binarize(scores.clone(), 0.5, 4)
    assert torch.equal(a, b)


def test_a_tie_at_the_cut_keeps_the_lower_channel_indices():
    """The cut falls inside a tie: 5 channels tie above the threshold, the head keeps round(5/4)*4 = 4 of them.

    The documented rule: among equal scores the lower channel index is kept. Each head puts its tied
    channels elsewhere (and a distinct top channel in some), so random, reversed or position-blind tie
    breaking keeps other channels.
    """
    g = torch.Generator().manual_seed(0)
    scores = torch.zeros(3, 4, 16)
    expected = torch.zeros(3, 4, 16, dtype=torch.bool)
    for layer in range(3):
        for head in range(4):
            tied = torch.randperm(16, generator=g)[:5].sort().values
            scores[layer, head, tied] = 2.0
            expected[layer, head, tied[:4]] = True  # the four lowest indices of the five tied channels
    # 60 zeros and 20 tied values per layer: the 0.5-quantile is 0, every tied channel is above it
    keep = binarize(scores, 0.5, 4)
    assert (keep.sum(-1) == 4).all()
    assert torch.equal(keep, expected)
    # the same with a distinct best channel first: it is kept, then the lowest-index tied ones
    scores[0, 0] = 0.0
    scores[0, 0, [2, 5, 8, 11]], scores[0, 0, 15] = 2.0, 3.0
    assert binarize(scores, 0.5, 4)[0, 0].nonzero().flatten().tolist() == [2, 5, 8, 15]


def test_the_ratio_is_over_the_pruned_layers_only():
    """Dense (sliding) layers take no part in the quantile: scores there (all high, or all low) do not move
    the threshold, so the pruned layer keeps exactly 1 - ratio of its channels, its highest ones."""
    pruned = torch.arange(2 * 16, dtype=torch.float32).reshape(2, 16) / 32  # distinct scores in [0, 1)
    for dense_value in (5.0, -5.0):
        scores = torch.stack([torch.full((2, 16), dense_value), pruned])
        keep = binarize(scores, 0.5, 4, dense_layers=(0,))
        assert bool(keep[0].all())
        assert torch.equal(keep[1], pruned >= pruned.flatten().sort().values[16])  # the top half of layer 1
        assert int(keep[1].sum()) == 16  # over both layers, the quantile would keep 0 (5.0) or 32 (-5.0)


def test_save_load_round_trip(tmp_path):
    mask = random_mask(base_model="org/model", base_revision="abc", loader={"gguf_file": "m.gguf"},
                       sink_size=4, recent_size=8, accumu_size=2, recipe="a: 1\n")
    mask.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_FILE, MASK_FILE]
    back = ChannelMask.from_pretrained(tmp_path)
    assert torch.equal(back.keep, mask.keep) and back.keep.dtype == torch.bool
    assert torch.equal(back.scores, mask.scores)
    cfg = json.loads((tmp_path / CONFIG_FILE).read_text())
    for key in ("format_version", "base_model", "base_revision", "loader", "num_layers", "num_kv_heads",
                "head_dim", "sink_size", "recent_size", "accumu_size", "ratio", "align", "recipe"):
        assert key in cfg
    assert (back.base_model, back.base_revision, back.loader) == ("org/model", "abc", {"gguf_file": "m.gguf"})
    assert (back.sink_size, back.recent_size, back.accumu_size, back.recipe) == (4, 8, 2, "a: 1\n")


def test_config_overrides_round_trip_and_version(tmp_path):
    """Overrides (YaRN) are written only when set, and make the file version 3: an older reader (versions
    1-2) would decode the base model without them, a model the mask was not learned on."""
    yarn = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 10000.0}}
    random_mask().save_pretrained(tmp_path / "plain")
    plain = json.loads((tmp_path / "plain" / CONFIG_FILE).read_text())
    assert plain["format_version"] == 1 and "config_overrides" not in plain
    random_mask(config_overrides=yarn).save_pretrained(tmp_path / "yarn")
    cfg = json.loads((tmp_path / "yarn" / CONFIG_FILE).read_text())
    assert cfg["format_version"] == 3 and cfg["config_overrides"] == yarn
    assert ChannelMask.from_pretrained(tmp_path / "yarn").config_overrides == yarn
    assert ChannelMask.from_pretrained(tmp_path / "plain").config_overrides == {}


@pytest.mark.parametrize(
    "overrides,match",
    [("yarn", "must be a JSON object"), ({"": 1}, "attribute names"), ({"rope_parameters": torch.ones(1)}, "plain JSON"),
     ({"rope_theta": float("nan")}, "plain JSON")],
    ids=["string", "empty-key", "tensor", "nan"],
)
def test_bad_config_overrides(tmp_path, overrides, match):
    with pytest.raises(MaskError, match=match):
        random_mask(config_overrides=overrides)
    random_mask().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / CONFIG_FILE).read_text())
    if isinstance(overrides, str):  # the same check on a downloaded config.json names the folder
        cfg["config_overrides"] = overrides
        (tmp_path / CONFIG_FILE).write_text(json.dumps(cfg))
        with pytest.raises(MaskError, match=f"{tmp_path.name}.*{match}"):
            ChannelMask.from_pretrained(tmp_path)


def test_saved_keep_is_uint8(tmp_path):
    from safetensors.torch import load_file

    random_mask().save_pretrained(tmp_path)
    assert load_file(str(tmp_path / MASK_FILE))["keep"].dtype == torch.uint8


def test_stats_counts_and_bytes():
    keep = torch.zeros(2, 2, 16, dtype=torch.bool)
    keep[0, 0, :8] = True  # 8 channels
    keep[1, 1, :] = True  # 16 channels, two heads at zero
    mask = ChannelMask(keep=keep, ratio=0.5, align=8)
    s = mask.stats(tiny_config("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16), dtype=torch.float16)
    assert s["k_kept_fraction"] == pytest.approx(24 / 64)
    assert s["v_kept_fraction"] == pytest.approx(2 / 4)
    assert s["zero_heads"] == 2
    assert s["per_layer"] == [[8, 0], [0, 16]]
    assert s["bytes_per_token"]["dense"] == 2 * 2 * 2 * 16 * 2
    assert s["bytes_per_token"]["leank"] == 24 * 2 + 2 * 16 * 2
    # after a prefill, the sink and the next query's recent part (10 back, down to a multiple of 5) stay full
    mask2 = ChannelMask(keep=keep, ratio=0.5, align=8, sink_size=4, recent_size=10, accumu_size=5)
    per = mask2.kv_bytes_per_token(torch.float32)
    assert mask2.kv_cache_bytes(100, 3, torch.float32) == 3 * (14 * per["dense"] + 86 * per["leank_middle"])
    assert mask2.kv_cache_bytes(12, 1, torch.float32) == 12 * per["dense"]  # nothing to prune


def test_validate_names_the_mismatch(family):
    mask = random_mask(layers=2, heads=2, dim=16)
    mask.validate(tiny_config(family))  # fits
    with pytest.raises(MaskError, match="num_layers"):
        mask.validate(tiny_config(family, num_hidden_layers=3))
    with pytest.raises(MaskError, match="num_kv_heads"):
        mask.validate(tiny_config(family, num_key_value_heads=4))
    with pytest.raises(MaskError, match="head_dim"):
        mask.validate(tiny_config(family, head_dim=32))


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, float("nan"), "0.7", True])
def test_bad_ratio(ratio):
    with pytest.raises(MaskError, match="ratio"):
        ChannelMask.from_scores(torch.rand(2, 2, 16), ratio, 4)


@pytest.mark.parametrize("align", [0, 3, 32, -4, 2.0])
def test_bad_align(align):
    with pytest.raises(MaskError, match="align"):
        ChannelMask.from_scores(torch.rand(2, 2, 16), 0.5, align)


def test_bad_scores():
    with pytest.raises(MaskError, match="layers, kv_heads, head_dim"):
        ChannelMask.from_scores(torch.rand(2, 16), 0.5, 4)
    with pytest.raises(MaskError, match="NaN"):
        ChannelMask.from_scores(torch.full((2, 2, 16), float("nan")), 0.5, 4)


def test_keep_must_be_binary():
    with pytest.raises(MaskError, match="0 and 1"):
        ChannelMask(keep=torch.full((2, 2, 16), 2, dtype=torch.uint8), ratio=0.5, align=4)


def _saved(tmp_path):
    random_mask().save_pretrained(tmp_path)
    return tmp_path


def test_unknown_format_version(tmp_path):
    folder = _saved(tmp_path)
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    cfg["format_version"] = 99
    (folder / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(MaskError, match="format_version 99"):
        ChannelMask.from_pretrained(folder)


def test_format_version_is_the_newest_read_and_written(tmp_path):
    """FORMAT_VERSION bounds what this leank reads (every version up to it, none above) and is what a mask
    recording config overrides is written as; a plain mask stays version 1, an adapter-only one version 2."""
    from leank_infer.mask.format import FORMAT_VERSION, format_version

    assert format_version(adapter=False, config_overrides=True) == FORMAT_VERSION
    assert format_version(adapter=True, config_overrides=False) == 2
    assert format_version(adapter=False, config_overrides=False) == 1
    folder = _saved(tmp_path)
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    for version in range(1, FORMAT_VERSION + 1):
        (folder / CONFIG_FILE).write_text(json.dumps({**cfg, "format_version": version}))
        assert ChannelMask.from_pretrained(folder).num_layers == cfg["num_layers"]
    (folder / CONFIG_FILE).write_text(json.dumps({**cfg, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(MaskError, match=f"format_version {FORMAT_VERSION + 1}"):
        ChannelMask.from_pretrained(folder)


def test_config_not_json(tmp_path):
    folder = _saved(tmp_path)
    (folder / CONFIG_FILE).write_text("{not json")
    with pytest.raises(MaskError, match="not valid JSON"):
        ChannelMask.from_pretrained(folder)


def test_config_missing_key(tmp_path):
    folder = _saved(tmp_path)
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    del cfg["sink_size"]
    (folder / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(MaskError, match="sink_size"):
        ChannelMask.from_pretrained(folder)


@pytest.mark.parametrize("keep_bytes", [10, 100, -1])
def test_truncated_safetensors(tmp_path, keep_bytes):
    folder = _saved(tmp_path)
    data = (folder / MASK_FILE).read_bytes()
    (folder / MASK_FILE).write_bytes(data[: keep_bytes if keep_bytes > 0 else len(data) - 7])
    with pytest.raises(MaskError, match="damaged or truncated"):
        ChannelMask.from_pretrained(folder)


def test_shape_disagrees_with_config(tmp_path):
    folder = _saved(tmp_path)
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    cfg["num_layers"] = 3
    (folder / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(MaskError, match="shape"):
        ChannelMask.from_pretrained(folder)


def test_missing_files(tmp_path):
    with pytest.raises(MaskError, match="missing"):
        ChannelMask.from_pretrained(tmp_path)  # an empty folder


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.torch

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError):
        random_mask().save_pretrained(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor a temporary sibling is left


def test_quantile_is_torch_quantiles_linear_interpolation():
    """binarize's own quantile (no 16M-element limit) is torch.quantile's linear interpolation, ends included."""
    from leank_infer.mask.binarize import _quantile

    flat = torch.tensor([0.0, 1, 4, 9, 16, 25])
    for q in (0.0, 0.1, 0.3, 0.5, 0.75, 0.9, 0.99, 1.0):
        torch.testing.assert_close(_quantile(flat, q), torch.quantile(flat, q), msg=f"q={q}")


def test_binarize_edges_whole_heads_dense_layer_indices_and_messages():
    """min_kept may be head_dim (each head keeps all or nothing); dense_layers index layers (3 of them here,
    2 KV heads); every layer dense and non-finite scores are refused with their own messages."""
    s = torch.rand(3, 2, 16, generator=torch.Generator().manual_seed(3))
    whole = binarize(s, 0.5, 4, min_kept=16).sum(-1)
    assert set(whole.flatten().tolist()) == {0, 16} and int(whole.sum()) == 48
    keep = binarize(s, 0.5, 4, dense_layers=(2,))
    assert bool(keep[2].all()) and torch.equal(keep[:2], binarize(s[:2], 0.5, 4))
    with pytest.raises(MaskError, match=r"^every layer is a dense \(sliding-window\) layer: LeanK has no global layer to prune$"):
        binarize(s, 0.5, 4, dense_layers=(0, 1, 2))
    with pytest.raises(MaskError, match=r"^scores contain NaN or inf; cannot binarise$"):
        binarize(s.clone().fill_(float("inf")), 0.5, 4)


@pytest.mark.parametrize(("n", "ratio", "kept"), [(8, 0.3, 6), (8, 0.45, 4), (8, 0.4375, 4), (8, 0.0, 7), (8, 0.175, 7),
                                                (4, 0.9, 0)])
def test_min_kept_takes_the_total_nearest_the_budget(n, ratio, kept):
    """min_kept > 0: the threshold (a score) whose kept total is nearest (1 - ratio) * channels; scores 0..n-1,
    one head: budget 5.6 keeps 6 (not 5), 4.4 keeps 4, a tie (4.5 between 4 and 5) the fewer, 8 all but the
    lowest, 6.6 keeps 7 (the first threshold's total), 0.4 of 4 channels keeps none (the last threshold's)."""
    s = torch.arange(float(n)).view(1, 1, n)
    keep = binarize(s, ratio, 1, min_kept=1)[0, 0]
    assert keep.tolist() == [False] * (n - kept) + [True] * kept


@pytest.mark.parametrize("bad", [[[]], [1, "a"], [0, 3], [True], "01", 5], ids=repr)
def test_dense_layers_that_are_not_layer_indices_get_one_mask_error(bad):
    """A config's dense_layers holding a list, a string, an index out of range or a bool (or being no list at all) is
    one MaskError naming it, never a TypeError from sorting or hashing; good indices come back sorted and distinct."""
    from leank_infer.mask.layers import check_dense_layers

    with pytest.raises(MaskError, match="dense_layers must be"):
        check_dense_layers(bad, 3)
    assert check_dense_layers([2, 0, 2], 3) == (0, 2)
