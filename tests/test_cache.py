"""The LeanK cache + decode attention against the dense LeanK rule (leank_attention), layer by layer."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import documented_recent_from
from torch import nn
from transformers.masking_utils import sdpa_mask

from leank_infer.decode import layer_handoff
from leank_infer.decode.attention import leank_attention_forward
from leank_infer.decode.cache import LeanKCache, LeanKLayer, Phase
from leank_infer.decode.layout import ChannelGroups
from leank_infer.decode.masked_attention import leank_attention
from leank_infer.mask import ChannelMask
from leank_infer.model.generation import CACHE_KWARG

pytestmark = pytest.mark.usefixtures("one_thread")


HKV, GROUPS, D = 4, 2, 16
SINK, RECENT, ACCUMU = 3, 6, 4


class _Attn(nn.Module):
    """The attributes transformers' SDPA path reads from an attention module."""

    is_causal = True
    num_key_value_groups = GROUPS


def _keep(seed: int = 0, counts: tuple[int, ...] = (0, 4, 8, 4)) -> torch.Tensor:
    """Mixed kept counts (default: one zero head, two heads with 4 (one group), one with 8); random channels."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.zeros(HKV, D, dtype=torch.bool)
    for h, count in enumerate(counts):
        keep[h, torch.randperm(D, generator=g)[:count]] = True
    return keep


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def offered_update(layer: LeanKLayer, k: torch.Tensor, v: torch.Tensor, kwargs: dict):
    """``layer.update`` as :class:`LeanKCache` calls it: the layer then offered to the attention call that
    receives the returned keys (leank_infer.decode.layer_handoff)."""
    keys, values = layer.update(k, v, kwargs=kwargs)
    layer_handoff.offer(keys, layer)
    return keys, values


class _Run:
    """Feeds random q/k/v through one LeanKLayer and the leank attention function, keeping the full K/V."""

    def __init__(
        self,
        keep: torch.Tensor,
        lengths: list[int],
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        dense_until: int = 0,
        rule: str = "dense-prompt",
    ):
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.keep = keep
        self.rule = rule
        self.layer = LeanKLayer(keep, SINK, RECENT, ACCUMU, dense_until=dense_until, rule=rule)
        t0 = max(lengths)
        self.pad = torch.zeros(len(lengths), t0, dtype=torch.bool)
        for b, n in enumerate(lengths):
            self.pad[b, t0 - n :] = True  # left padding
        self.starts = (~self.pad).sum(-1)
        self.k = self.v = None
        self.prefill = None

    @property
    def recent_from(self) -> int:
        """First full recent key of the last query of an unpadded row (docs/rule.md's formula)."""
        return documented_recent_from(self.k.shape[2] - 1, RECENT, ACCUMU)

    def _rand(self, q_len: int):
        b = self.pad.shape[0]
        r = lambda h: torch.randn(b, h, q_len, D, generator=self.gen).to(self.dtype)  # noqa: E731
        return r(HKV * GROUPS), r(HKV), r(HKV)

    def step(self, q_len: int, two_d: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of ``q_len`` new tokens; returns (LeanK output, the 4D mask the model would build;
        ``two_d``: the attention gets the 2-D padding mask itself instead)."""
        q, k, v = self._rand(q_len)
        past = 0 if self.k is None else self.k.shape[2]
        if past:
            self.pad = torch.cat([self.pad, torch.ones(self.pad.shape[0], q_len, dtype=torch.bool)], 1)
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        mask = sdpa_mask(
            batch_size=q.shape[0],
            q_length=q_len,
            kv_length=past + q_len,
            q_offset=past,
            attention_mask=self.pad,
        )
        if self.prefill is None:
            self.prefill = past + q_len
        real = self.pad[:, : past + q_len].long()
        kwargs: dict = {"position_ids": (real.cumsum(-1) - 1).clamp_min(0)[:, -q_len:]}  # as generate() numbers them
        kk, vv = offered_update(self.layer, k, v, kwargs)
        given = self.pad[:, : past + q_len] if two_d else mask
        out, _ = leank_attention_forward(_Attn(), q, kk, vv, given, scaling=D**-0.5, **kwargs)
        self.q = q
        return out, mask

    def reference(self, upcast: bool = False, dense: bool = False) -> torch.Tensor:
        """The LeanK rule over every key so far, ``leank_attention(accumu_size=ACCUMU)``: every query under the
        positional rule, every query after the prompt under dense-prompt; the prompt's queries under dense-prompt
        and ``dense`` (every channel of every key, i.e. the model's own attention) per query."""
        total, q_len = self.k.shape[2], self.q.shape[2]
        cast = (lambda t: t.float()) if upcast else (lambda t: t)  # noqa: E731
        if self.rule == "positional" or (not dense and total > self.prefill):
            return leank_attention(
                cast(self.q), cast(self.k), cast(self.v), self.keep.float(), torch.arange(total - q_len, total),
                SINK, RECENT, D**-0.5, key_start=self.starts, key_padding_mask=self.pad, skip_zero_heads=True,
                accumu_size=ACCUMU,
            )
        outs = []
        for i in range(q_len):
            p = total - q_len + i
            outs.append(
                leank_attention(
                    cast(self.q[:, :, i : i + 1]),
                    cast(self.k[:, :, : p + 1]),
                    cast(self.v[:, :, : p + 1]),
                    torch.ones_like(self.keep, dtype=torch.float32) if dense else self.keep.float(),
                    torch.tensor([p]),
                    SINK,
                    p + 1,  # every key is recent: the dense prompt (or dense)
                    D**-0.5,
                    key_start=self.starts,
                    key_padding_mask=self.pad[:, : p + 1],
                    skip_zero_heads=True,
                )
            )
        return torch.cat(outs, 1)


@pytest.mark.parametrize(
    "lengths", [[25], [25, 18], [9, 25], [5, 12]], ids=["b1", "b2-pad-second", "b2-pad-first", "b2-short"]
)
def test_decode_equals_dense_leank_rule(lengths):
    run = _Run(_keep(), lengths)
    run.step(max(lengths))  # prefill: plain attention, then compression
    mids = {run.layer.mid_len}
    for q_len in [1] * 9 + [3] + [1] * 6 + [5, 1]:
        out, _ = run.step(q_len)
        assert _rel_err(out, run.reference()) < 1e-5
        mids.add(run.layer.mid_len)
    assert len(mids) >= 3, "the accumulation buffer never moved tokens to the middle"


@pytest.mark.parametrize("path", ["fast", "general"])
@pytest.mark.parametrize("keep", ["mixed", "no-zero-head"])
def test_fast_and_general_torch_paths_follow_the_rule(monkeypatch, path, keep):
    """The PyTorch backend's fused path (one query, nothing to mask) and its general path each equal the
    rule; the general one is forced here, the fast one checked to have run."""
    from leank_infer.decode import torch_decode

    used = []
    real = torch_decode.fast_path_applies
    monkeypatch.setattr(
        torch_decode,
        "fast_path_applies",
        lambda *a: used.append(real(*a)) or (path == "fast" and used[-1]),
    )
    # "no-zero-head": groups in KV-head order, the fast path's merge without index shuffles
    mask = _keep() if keep == "mixed" else _keep(counts=(4, 4, 8, 12))
    run = _Run(mask, [33, 33])
    run.step(33)
    for q_len in [1] * 12 + [2, 1]:
        out, _ = run.step(q_len)
        assert _rel_err(out, run.reference()) < 1e-5
    assert any(used) and not all(used)  # one-query steps can take the fused path, the 2-query one cannot


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_half_precision_stays_close_to_the_fp32_rule(dtype, tol):
    """Caches in half precision: fp32 softmax and merging keep the result within the dtype's rounding."""
    run = _Run(_keep(), [25, 18], dtype=dtype)
    run.step(25)
    for q_len in [1] * 6 + [2, 1]:
        out, _ = run.step(q_len)
        assert out.dtype == dtype
        want = run.reference(upcast=True)
        assert _rel_err(out.float(), want) < tol


def test_zero_heads_skip_their_middle_keys():
    """A zero-channel head attends only to sink + recent: its output ignores middle V entirely."""
    run = _Run(_keep(), [30])
    run.step(30)
    out1, _ = run.step(1)
    # shift every middle V in the dense copy: the zero head (kv head 0) must not notice
    zero_q = slice(0, GROUPS)  # query heads of kv head 0
    run.v[:, :, SINK : run.recent_from] += 100.0
    ref = run.reference()
    assert _rel_err(out1[:, :, zero_q], ref[:, :, zero_q]) < 1e-5
    # while the other heads do read middle V
    assert _rel_err(out1[:, :, GROUPS:], ref[:, :, GROUPS:]) > 1e-2


def test_prefill_layout_and_storage():
    keep = _keep()
    run = _Run(keep, [40])
    run.step(40)
    layer = run.layer
    recent_from = documented_recent_from(40, RECENT, ACCUMU)  # the next query's: what stays full
    assert (layer.head_len, layer.mid_len, layer.tail_len) == (SINK, recent_from - SINK, 40 - recent_from)
    counts = keep.sum(-1)
    assert [k.shape[-1] for k in layer.mid_k] == [int(c) for c in counts if c > 0]  # runs of equal count
    assert layer.mid_v.shape[1] == int((counts > 0).sum())  # no V for the zero head
    # middle K really holds only the kept channels of each head
    for heads, channels, k in zip(layer.groups.heads, layer.groups.channels, layer.mid_k, strict=True):
        full = run.k[:, heads, SINK : SINK + layer.mid_len]
        want = full.gather(-1, channels.view(1, len(heads), 1, -1).expand(1, len(heads), layer.mid_len, -1))
        assert torch.equal(k, want)
    item = 4
    mask = ChannelMask(
        keep=keep.unsqueeze(0), sink_size=SINK, recent_size=RECENT, accumu_size=ACCUMU, align=4
    )
    assert layer.nbytes() == mask.kv_cache_bytes(40, 1, torch.float32)
    assert layer.nbytes() < 2 * 40 * HKV * D * item


def test_middle_k_stays_channel_major_through_growth_and_beam_reorder():
    """Middle K is stored channel-major (each kept channel's keys contiguous: the decode's score product
    and the kernel's no-copy path read it so) after the prefill, after the middle grows past its
    capacity, and after generate reorders beams; and it still holds exactly the kept channels."""
    run = _Run(_keep(), [30, 30], seed=5)
    run.step(30)
    layer = run.layer

    def check() -> None:
        for heads, channels, k in zip(layer.groups.heads, layer.groups.channels, layer.mid_k, strict=True):
            assert k.stride(2) == 1 and k.stride(3) >= layer.mid_len  # [B, Hg, c, cap] storage
            full = run.k[:, heads, SINK : SINK + layer.mid_len]
            idx = channels.view(1, len(heads), 1, -1).expand(full.shape[0], len(heads), layer.mid_len, -1)
            assert torch.equal(k, full.gather(-1, idx))

    check()
    first_cap = layer._mid_v.shape[2]
    while layer._mid_v.shape[2] == first_cap:  # decode until the middle has grown at least once
        run.step(1)
    check()
    beams = torch.tensor([1, 0])
    layer.reorder_cache(beams)
    run.k, run.v = run.k[beams], run.v[beams]
    check()


def test_channel_groups_are_runs_of_equal_count_in_head_order():
    """Groups are runs of consecutive KV heads with one nonzero count, middle V in KV-head order:
    scores and V stay in head order at decode (no index shuffles)."""
    g = ChannelGroups.from_keep(_keep(counts=(0, 4, 4, 8)))
    assert g.counts == (4, 8)
    assert [h.tolist() for h in g.heads] == [[1, 2], [3]]
    assert g.nonzero_order.tolist() == [1, 2, 3]
    assert g.v_offsets == (0, 2)
    assert g.nonzero.tolist() == [False, True, True, True]
    assert g.runs() == ((0, 1, None), (1, 4, 0))
    g = ChannelGroups.from_keep(_keep())  # counts 0, 4, 8, 4: the two 4s are not neighbours
    assert g.counts == (4, 8, 4) and [h.tolist() for h in g.heads] == [[1], [2], [3]]
    assert g.runs() == ((0, 1, None), (1, 4, 0))
    g = ChannelGroups.from_keep(_keep(counts=(4, 0, 0, 8)))
    assert g.runs() == ((0, 1, 0), (1, 3, None), (3, 4, 1)) and g.v_offsets == (0, 1)


def test_batch_select_keeps_rows_consistent():
    """A row selected out of a padded batch decodes as it did in the batch, even with no mask at all:
    the layer keeps each row's start, so padding stays out of the head."""
    run = _Run(_keep(), [20, 14], seed=3)
    run.step(20)
    for _ in range(6):
        run.step(1)
    single = copy.deepcopy(run.layer)
    cache = LeanKCache(
        ChannelMask(
            keep=_keep().unsqueeze(0), sink_size=SINK, recent_size=RECENT, accumu_size=ACCUMU, align=4
        )
    )
    cache.layers = [single]
    cache.batch_select_indices(torch.tensor([1]))
    assert single.starts.tolist() == [6]
    batch_out, _ = run.step(1)
    kk, vv = offered_update(single, run.k[1:, :, -1:], run.v[1:, :, -1:], {})
    one, _ = leank_attention_forward(_Attn(), run.q[1:], kk, vv, None, scaling=D**-0.5)
    assert _rel_err(one, batch_out[1:]) < 1e-5


@pytest.mark.parametrize("lengths", [[25], [25, 18]], ids=["b1", "b2-pad"])
def test_dense_until_decodes_dense_then_exactly_the_compressed_cache(lengths):
    """Under ``dense_until`` a step is the model's dense attention over every token (full bytes held); the
    first step at or past it leaves the layer exactly as a cache compressed all along (same regions,
    same stored tensors, same bytes) and from then on the output is the LeanK rule."""
    until = 31  # reached exactly before the 3-token step (25 + 6 single steps)
    run, twin = _Run(_keep(), lengths, dense_until=until), _Run(_keep(), lengths)  # same seed: same q/k/v
    run.step(max(lengths))
    twin.step(max(lengths))
    assert run.layer.mid_len == 0 < twin.layer.mid_len
    b, crossed = len(lengths), False
    for q_len in [1] * 6 + [3] + [1] * 8:
        past = run.layer.length
        out, _ = run.step(q_len)
        twin.step(q_len)
        if past < until:
            assert _rel_err(out, run.reference(dense=True)) < 1e-5
            assert _rel_err(out, run.reference()) > 1e-3, "the rule and dense attention should differ here"
            assert run.layer.nbytes() == b * run.layer.length * HKV * 2 * D * 4  # every token, every channel
            continue
        crossed = True
        assert _rel_err(out, run.reference()) < 1e-5
        a, t = run.layer.layout(), twin.layer.layout()
        assert (run.layer.head_len, run.layer.mid_len, run.layer.tail_len) == (
            twin.layer.head_len, twin.layer.mid_len, twin.layer.tail_len)
        assert torch.equal(a.full_k, t.full_k) and torch.equal(a.full_v, t.full_v) and torch.equal(a.mid_v, t.mid_v)
        assert all(torch.equal(x, y) for x, y in zip(a.mid_k, t.mid_k, strict=True))
        assert run.layer.nbytes() == twin.layer.nbytes()
        assert run.layer.allocated_bytes() <= twin.layer.allocated_bytes() + 2 * b * HKV * D * 4 * (ACCUMU + 1)
    assert crossed


def test_dense_until_at_or_below_the_prompt_compresses_at_prefill():
    run, twin = _Run(_keep(), [25], dense_until=25), _Run(_keep(), [25])
    run.step(25)
    twin.step(25)
    assert run.layer.mid_len == twin.layer.mid_len > 0
    with pytest.raises(ValueError, match="dense_until"):
        LeanKLayer(_keep(), SINK, RECENT, ACCUMU, dense_until=-1)


def test_crop_drops_only_uncompressed_tokens():
    run = _Run(_keep(), [30])
    run.step(30)
    run.step(1)
    run.step(1)
    n = run.layer.length
    run.layer.crop(-1)
    assert run.layer.length == n - 1
    with pytest.raises(ValueError, match="uncompressed"):
        run.layer.crop(-20)
    with pytest.raises(ValueError, match="negative"):
        run.layer.crop(3)


def test_cache_refuses_other_attention_implementations(family):
    from conftest import tiny_model

    model = tiny_model(family)
    model.set_attn_implementation("sdpa")
    mask = ChannelMask.full(2, 2, 16, sink_size=2, recent_size=4, accumu_size=2)
    cache = LeanKCache(mask, config=model.config)
    ids = torch.randint(3, 128, (1, 12))
    with torch.no_grad():
        model(ids, **{CACHE_KWARG: cache})
        with pytest.raises(RuntimeError, match="attn_implementation='leank'"):
            model(ids[:, :1], **{CACHE_KWARG: cache})


def test_row_starts_come_from_position_ids():
    """The cache compresses at its prefill update, before any attention: row starts come from generate's
    position ids (real tokens numbered from 0 after left padding)."""
    layer = LeanKLayer(_keep(), SINK, RECENT, ACCUMU)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 0, 0, 0, 0, 1, 2, 3, 4, 5]])  # row 1: 4 pads
    k, v = torch.randn(2, HKV, 10, D), torch.randn(2, HKV, 10, D)
    layer.update(k, v, kwargs={"position_ids": pos})
    assert layer.phase is Phase.PREFILLING
    assert layer.starts.tolist() == [0, 4]
    assert layer.head_len == 4 + SINK
    layer.update(k[:, :, :1], v[:, :, :1], kwargs={})
    assert layer.phase is not Phase.PREFILLING


def test_padding_the_positions_do_not_show_is_refused():
    """A left-padded mask whose position ids number the padding (a plain forward without position_ids)
    would put padding into the sink: the prefill attention says so instead of decoding wrongly."""
    run = _Run(_keep(), [20, 14])
    layer = run.layer
    q, k, v = run._rand(20)
    mask = sdpa_mask(batch_size=2, q_length=20, kv_length=20, q_offset=0, attention_mask=run.pad)
    kwargs: dict = {"position_ids": torch.arange(20).expand(2, 20)}
    k, v = offered_update(layer, k, v, kwargs)
    with pytest.raises(ValueError, match="position_ids"):
        leank_attention_forward(_Attn(), q, k, v, mask, scaling=D**-0.5, **kwargs)


def test_bytes_count_an_empty_cache_as_nothing_and_sliding_layers_as_their_storage():
    """A cache before any token holds 0 bytes; with Gemma 2's sliding layer 0 (the model's own cache layer)
    its bytes are that layer's K/V storage plus the LeanK layer's formula."""
    from conftest import tiny_model

    from leank_infer import LeanKModel

    model = tiny_model("gemma2")
    scores = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(6))
    mask = ChannelMask.from_scores(scores, 0.5, 4, sink_size=SINK, recent_size=RECENT, accumu_size=ACCUMU,
                                   dense_layers=(0,))
    lk = LeanKModel(model, mask)
    cache = lk.new_cache()
    assert cache.nbytes() == 0
    with torch.no_grad():
        lk(torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(7)), cache=cache)
    sliding, pruned = cache.layers
    assert cache.leank_layers == [1] and pruned.nbytes() > 0
    held = sliding.keys.untyped_storage().nbytes() + sliding.values.untyped_storage().nbytes()
    assert held > 0 and cache.nbytes() == held + pruned.nbytes()


def test_an_accumulation_of_one_token_rolls_one_key_per_step(monkeypatch):
    """accumu_size 1: every decode step past recent + 1 full keys moves exactly one key to the middle, and the
    output stays the documented rule's. A layer updated without attention kwargs prefills as an unpadded batch."""
    monkeypatch.setitem(globals(), "ACCUMU", 1)
    run = _Run(_keep(), [25])
    run.step(25)
    mids = [run.layer.mid_len]
    for _ in range(6):
        out, _ = run.step(1)
        assert _rel_err(out, run.reference()) < 1e-5
        mids.append(run.layer.mid_len)
    # the prefill leaves RECENT (6) full keys, the first query's own makes RECENT + 1; from the second query
    # on, each step rolls one key
    assert [b - a for a, b in zip(mids, mids[1:], strict=False)] == [0, 1, 1, 1, 1, 1], mids
    layer = LeanKLayer(_keep(), SINK, RECENT, 1)
    k = torch.randn(2, HKV, 12, D)
    got_k, got_v = layer.update(k, k)
    assert got_k is k and layer.starts.tolist() == [0, 0] and layer.length == 12


# ---- issue #31 items 11-13 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("two_d", [False, True], ids=["4d-mask", "2d-mask"])
def test_a_padding_mask_with_holes_in_the_middle_is_followed(two_d):
    """Item 12: a mask that hides keys in the middle (not only left padding) hides them at decode too, as in
    the rule with the same mask (dropping the middle's visibility changed the output by 0.34)."""
    run = _Run(_keep(), [30, 24])
    run.step(30)
    assert run.layer.mid_len > 10
    run.pad[:, 10:14] = False  # holes in both rows' middle, and one more in row 1's
    run.pad[1, 18] = False
    for q_len in [1, 1, 1, 2, 1]:
        out, _ = run.step(q_len, two_d=two_d)
        assert _rel_err(out, run.reference()) < 1e-5
    plain = _Run(_keep(), [30, 24])  # the holes matter: without them the output differs
    plain.step(30)
    for q_len in [1, 1, 1, 2, 1]:
        plain_out, _ = plain.step(q_len)
    assert _rel_err(plain_out, out) > 1e-2


def test_row_starts_from_the_hint_follow_expanded_rows():
    """Item 11: transformers < 5.20 gives the prefill no position_ids; generate's cache hook hints each prompt's
    start, and generate expands rows after (beams, num_return_sequences): each expanded row keeps its own
    prompt's start ([0, 0, 5, 5] for starts [0, 5] expanded 2x, not [0, 5, 0, 5]). Tested on the layer, so it
    runs on every transformers version."""
    keep = _keep()
    mask = ChannelMask(keep=keep.unsqueeze(0), sink_size=SINK, recent_size=RECENT, accumu_size=ACCUMU, ratio=0.5,
                       align=4)
    cache = LeanKCache(mask)
    cache.prefill_starts = torch.tensor([0, 5])
    k, v = torch.randn(4, HKV, 20, D), torch.randn(4, HKV, 20, D)
    cache.update(k, v, 0)  # no position_ids, as transformers < 5.20 calls it
    layer = cache.layers[0]
    assert layer.starts.tolist() == [0, 0, 5, 5]
    assert layer.head_len == 5 + SINK and layer.padded
    starts = LeanKLayer(keep, SINK, RECENT, ACCUMU)
    starts.starts_hint = torch.tensor([2, 0, 7])  # three prompts, three sequences each
    starts.update(torch.randn(9, HKV, 20, D), torch.randn(9, HKV, 20, D), kwargs={})
    assert starts.starts.tolist() == [2, 2, 2, 0, 0, 0, 7, 7, 7]


def test_crop_back_to_where_the_next_query_finds_its_keys_whole_is_allowed():
    """Item 13: crop may drop every token whose loss still leaves the next query each key it scores with all
    channels whole (assisted decoding can reach that length), and not one more."""
    for steps in (0, 3, 9):
        run = _Run(_keep(), [30])
        run.step(30)
        for _ in range(steps):
            run.step(1)
        layer = run.layer
        whole_from = layer.head_len + layer.mid_len
        shortest = min(n for n in range(whole_from, layer.length + 1)
                       if documented_recent_from(n, RECENT, ACCUMU) >= whole_from)
        drop = layer.length - shortest
        with pytest.raises(ValueError, match="uncompressed"):
            copy.deepcopy(layer).crop(-(drop + 1))
        layer.crop(-drop)
        assert layer.length == shortest


# ---- the positional rule -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "lengths", [[25], [25, 18], [9, 25], [5, 12], [30, 27, 21]],
    ids=["b1", "b2-pad-second", "b2-pad-first", "b2-short", "b3-pad"],
)
def test_positional_prefill_and_decode_equal_the_rule(lengths):
    """rule="positional": the prefill's attention and every later step (one token, or several at once) equal
    ``leank_attention(accumu_size=A)`` over the uncompressed K/V, rows left-padded by different amounts (so
    rows reach a key at different steps), a head keeping nothing among them; compressions happen."""
    run = _Run(_keep(), lengths, rule="positional")
    out, _ = run.step(max(lengths))
    assert run.layer.phase is Phase.PREFILLING
    assert _rel_err(out, run.reference()) < 1e-5
    dense = leank_attention(run.q, run.k, run.v, torch.ones(HKV, D), torch.arange(max(lengths)), SINK, RECENT,
                            D**-0.5, key_start=run.starts, key_padding_mask=run.pad)
    assert _rel_err(out, dense) > 1e-3, "the prefill should not be dense under the positional rule"
    mids = {run.layer.mid_len}
    for q_len in [1] * 9 + [3] + [1] * 6 + [5, 1, 7, 1, 1]:
        out, _ = run.step(q_len)
        assert _rel_err(out, run.reference()) < 1e-5, (q_len, run.layer.length)
        mids.add(run.layer.mid_len)
    assert len(mids) >= 4, "the cache never moved tokens to the middle"


@pytest.mark.parametrize("q_chunk", [5, 16, 256])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_positional_prefill_attention_equals_the_reference(q_chunk, softcap):
    """The prompt's attention under the positional rule (kept-channel scores everywhere, full ones only in the
    head and the chunk's recent band) equals ``leank_attention(accumu_size=A)``: chunks of queries whose band
    lies past the head or overlaps it, rows padded by more than a sink, a head keeping nothing, a soft-cap,
    the model's own mask on top (here it also hides one key from every query)."""
    from leank_infer.decode.positional_prefill import positional_prefill_attention

    g = torch.Generator().manual_seed(11)
    b, t = 3, 45
    q, k, v = (torch.randn(b, h, t, D, generator=g) for h in (HKV * GROUPS, HKV, HKV))
    starts = torch.tensor([0, 7, 19])
    pad = torch.arange(t).view(1, t) >= starts.view(b, 1)
    keep = _keep()
    got = positional_prefill_attention(q, k, v, keep, starts, SINK, RECENT, ACCUMU, D**-0.5, softcap, q_chunk=q_chunk)
    want = leank_attention(q, k, v, keep.float(), torch.arange(t), SINK, RECENT, D**-0.5, key_start=starts,
                           key_padding_mask=pad, skip_zero_heads=True, softcap=softcap, accumu_size=ACCUMU)
    assert _rel_err(got, want) < 1e-5
    hidden = pad.clone()
    hidden[:, 30] = False  # a custom mask: key 30 hidden from every query
    mask = sdpa_mask(batch_size=b, q_length=t, kv_length=t, q_offset=0, attention_mask=hidden)
    got = positional_prefill_attention(q, k, v, keep, starts, SINK, RECENT, ACCUMU, D**-0.5, softcap, mask,
                                       q_chunk=q_chunk)
    want = leank_attention(q, k, v, keep.float(), torch.arange(t), SINK, RECENT, D**-0.5, key_start=starts,
                           key_padding_mask=hidden, skip_zero_heads=True, softcap=softcap, accumu_size=ACCUMU)
    assert _rel_err(got, want) < 1e-5
    # the last 10 positions only (queries after a cached prefix): the same rows of the whole
    args = (keep, starts, SINK, RECENT, ACCUMU, D**-0.5, softcap)
    whole = positional_prefill_attention(q, k, v, *args, q_chunk=q_chunk)
    tail = positional_prefill_attention(q[:, :, -10:], k, v, *args, q_chunk=q_chunk)
    torch.testing.assert_close(tail, whole[:, -10:], atol=1e-6, rtol=1e-5)
