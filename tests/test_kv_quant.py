"""kv_quant: the quantised LeanK middle (issue #33) against an independent reading of its storage.

Every reference here dequantises the store's raw codes, scales and minima token by token with plain indexing
(:func:`_dequant_store`), never through the code under test, so a wrong group index, phase, nibble order or
parameter slice in the backends shows up as a difference.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_cache import ACCUMU, HKV, RECENT, SINK, D, _keep, _rel_err, _Run

from leank_infer.decode import kv_quant as kq
from leank_infer.decode.cache import LeanKCache, LeanKLayer
from leank_infer.decode.layout import DecodeMasks
from leank_infer.decode.quant_middle import CorruptQuantError
from leank_infer.decode.torch_decode import torch_decode_attention
from leank_infer.mask import ChannelMask
from leank_infer.mask.kv_bytes import PARAM_BYTES, prefilled_cache_bytes, quantized_middle_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

FORMATS = {
    "int8": kq.KVQuant("int8", 8, k_group=4, v_group=8),
    "int4": kq.KVQuant("int4", 4, k_group=4, v_group=8),
    "int4-k8": kq.KVQuant("int4", 4, k_group=8, v_group=16),  # a K group larger than accumu: open groups
}


# ---- the format ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kind", ["normal", "offset", "outlier-channel", "constant", "tiny"])
def test_round_trip_is_within_half_a_step(bits, kind):
    """quantise -> dequantise is within the stated bound, ``scale / 2`` per value, on hard inputs too: a large
    common offset (float16 minima rounded outward), an outlier, a constant group, values near float16's tiny."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(3, 5, 64, generator=g)
    if kind == "offset":
        x = x * 0.01 + 1000.0
    elif kind == "outlier-channel":
        x[:, 2] *= 300
    elif kind == "constant":
        x[:] = 3.14159
    elif kind == "tiny":
        x = x * 1e-6
    levels = (1 << bits) - 1
    scale, mn = kq.quant_params(x, 16, levels)
    assert scale.dtype == mn.dtype == kq.PARAM_DTYPE and scale.shape == (3, 5, 4)
    codes = kq.quantize(x, scale, mn, 16, levels)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= levels
    back = kq.dequantize(codes, scale, mn, 16)
    bound = kq.max_error(scale).repeat_interleave(16, -1)
    err = (back - x).abs()
    assert bool((err <= bound * (1 + 1e-3) + 1e-6 * x.abs()).all()), float((err - bound).max())
    if kind == "normal":  # the bound is tight: most of a step's half is used somewhere
        assert float(err.max()) > 0.4 * float(bound.max())


@pytest.mark.parametrize("levels", [255, 15])
def test_the_float16_grid_is_rounded_outward_and_covers_every_value(levels):
    """The minimum is rounded down and the scale up to float16, so ``minimum <= group min`` and ``minimum + levels x
    scale >= group max`` in exact arithmetic for every group (rounding to nearest misses about half of them)."""
    g = torch.Generator().manual_seed(levels)
    exact = torch.arange(16.0).repeat(16) * 0.25 - 2  # groups whose minimum and step are float16 numbers
    x = torch.cat([torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g) * 37 + 1000,
                   torch.rand(64, 256, generator=g) * 1e-3 - 5, exact[None] * (levels // 15)], 0)
    scale, mn = kq.quant_params(x, 16, levels)
    assert scale.shape == mn.shape == (x.shape[0], 16)
    grp = x.double().unflatten(-1, (-1, 16))
    lo, hi = grp.amin(-1), grp.amax(-1)
    assert bool((mn.double() <= lo).all())
    assert bool((mn.double() + levels * scale.double() >= hi).all())
    # and tightly, per group: the next float16 up would not be below the minimum, one less scale would not cover
    assert bool((torch.nextafter(mn, torch.full_like(mn, float("inf"))).double() > lo).all())
    smaller = torch.nextafter(scale, torch.zeros_like(scale)).double()
    above_floor = scale > torch.finfo(kq.PARAM_DTYPE).tiny  # steps under float16's smallest normal take that
    assert bool((mn.double() + levels * smaller < hi)[above_floor].all()) and float(above_floor.float().mean()) > 0.6
    if levels == 15:  # the exact groups: minimum -2 and step 0.25 as they are
        assert mn[-1].tolist() == [-2.0] * 16 and scale[-1].tolist() == [0.25] * 16


def test_int4_packs_two_channels_a_byte_even_low_odd_high():
    codes = torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.uint8)
    packed = kq.pack(codes, -1, 2)
    assert packed.tolist() == [[1 | 2 << 4, 3 | 4 << 4, 5]]
    assert kq.unpack(packed, -1, 2, 5).tolist() == codes.tolist()
    col = codes.T.contiguous()  # along another axis
    assert kq.unpack(kq.pack(col, 0, 2), 0, 2, 5).tolist() == col.tolist()


def test_non_finite_or_out_of_range_values_are_refused():
    x = torch.randn(2, 32)
    nan, beyond = "holding NaN or inf values (kv_quant)", "beyond +/-65504: kv_quant keeps float16 scales"
    for bad, says in ((float("nan"), nan), (float("inf"), nan), (-float("inf"), nan), (1e6, beyond), (-1e6, beyond),
                      (70000.0, beyond)):
        y = x.clone()
        y[1, 3] = bad
        with pytest.raises(ValueError, match=f"^cannot quantise K/V {re.escape(says)}$"):
            kq.quant_params(y, 16, 255)
    edge = torch.zeros(2, 32)
    edge[0, :16], edge[1, 16:] = 65504.0, -65504.0  # float16's largest, each in a group of its own: accepted
    scale, mn = kq.quant_params(edge, 16, 255)
    assert mn.tolist() == [[65504.0, 0.0], [0.0, -65504.0]]
    with pytest.raises(ValueError, match="kv_quant must be one of"):
        kq.kv_quant_format("int3")
    with pytest.raises(ValueError, match="power of two"):
        kq.KVQuant("int8", 8, k_group=24)


# ---- an independent reading of the store -------------------------------------------------------------
def _dequant_store(layer: LeanKLayer) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(kept K per head group ``[B, Hg, n, c]``, V ``[B, Hnz, n, D]``) from the raw storage, token by token."""
    st = layer._quant
    fmt, n, ph = st.fmt, st.n, st.phase

    def code(row: torch.Tensor, i: int) -> torch.Tensor:  # code i of a row of packed bytes (last axis)
        if fmt.per_byte == 1:
            return row[..., i].float()
        byte = row[..., i // 2]
        return ((byte >> 4) if i % 2 else (byte & 15)).float()

    ks = []
    for gi, c in enumerate(layer.groups.counts):
        codes, scale, mn = st.k_codes[gi], st.k_scale[gi].float(), st.k_min[gi].float()
        out = torch.empty(*codes.shape[:2], n, c)
        for j in range(n):
            s = ph + j
            grp = s // fmt.k_group
            for ch in range(c):
                out[:, :, j, ch] = code(codes[:, :, :, s], ch) * scale[:, :, ch, grp] + mn[:, :, ch, grp]
        ks.append(out)
    vg = st.v_group
    v = torch.empty(*st.v_codes.shape[:2], n, st.v_dim)
    for j in range(n):
        for ch in range(st.v_dim):
            v[:, :, j, ch] = code(st.v_codes[:, :, j], ch) * st.v_scale[:, :, j, ch // vg].float() + \
                st.v_min[:, :, j, ch // vg].float()
    return ks, v


def _with_dequantised_middle(run: _Run) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's full K/V with the middle's tokens replaced by the store's values (kept channels; V of nonzero
    heads): what the decode must compute over, by the rule."""
    layer = run.layer
    k, v = run.k.clone(), run.v.clone()
    h, n = layer.head_len, layer.mid_len
    ks, vs = _dequant_store(layer)
    for (heads, channels), kd in zip(zip(layer.groups.heads, layer.groups.channels, strict=True), ks, strict=True):
        for i, head in enumerate(heads.tolist()):
            k[:, head, h : h + n][..., channels[i]] = kd[:, i]
    v[:, layer.groups.nonzero_order, h : h + n] = vs
    return k, v


def _check_store(run: _Run) -> None:
    """The stored middle dequantises to the original K/V within half a step of each value's scale."""
    layer, st = run.layer, run.layer._quant
    h, n = layer.head_len, layer.mid_len
    if n == 0:
        return
    k, v = _with_dequantised_middle(run)
    kmax = max(float(s[..., : st.k_groups()].float().max()) for s in st.k_scale) if st.k_scale else 0.0
    vmax = float(st.v_scale[:, :, :n].float().max())
    keep = layer.groups.keep
    dk = (k - run.k)[:, :, h : h + n] * keep[None, :, None, :]
    assert float(dk.abs().max()) <= kmax / 2 * 1.001 + 1e-6
    assert float((v - run.v)[:, :, h : h + n].abs().max()) <= vmax / 2 * 1.001 + 1e-6


@pytest.mark.parametrize("fmt", ["int8", "int4-k8"])
def test_writes_of_any_size_keep_every_middle_token_within_half_a_step(fmt):
    """Writes of irregular sizes (the positional rule's, a K group larger than a write): the open K group's tokens are
    requantised from their originals each time, so after every write each stored K and V value is within half a
    step of the value written, read back from the raw codes token by token."""
    from leank_infer.decode.layout import ChannelGroups
    from leank_infer.decode.quant_middle import QuantMiddleStore

    def kept(k: torch.Tensor, heads: torch.Tensor, ch: torch.Tensor) -> torch.Tensor:  # [B, Hg, m, c]
        return k[:, heads].gather(-1, ch[None, :, None, :].expand(k.shape[0], -1, k.shape[2], -1))

    q = FORMATS[fmt]
    g = torch.Generator().manual_seed(3)
    keep = torch.zeros(3, 16, dtype=torch.bool)
    keep[0, :5], keep[1, ::3], keep[2, 4:9] = True, True, True  # groups of 5, 6 and 5 channels
    groups = ChannelGroups.from_keep(keep)
    store = QuantMiddleStore(q, groups, 2, 16, torch.float32, torch.device("cpu"), 4)
    ks, vs = [], []
    for m in (5, 3, 6, 2, 7, 1, 9, 4):
        k = torch.randn(2, 3, m, 16, generator=g) * (1 + 10 * torch.rand(1, 3, 1, 16, generator=g))
        v = torch.randn(2, 3, m, 16, generator=g)
        store.write([kept(k, heads, ch) for heads, ch in zip(groups.heads, groups.channels, strict=True)],
                    v[:, groups.nonzero_order], 64)
        ks.append(k)
        vs.append(v)
        kall, vall = torch.cat(ks, 2), torch.cat(vs, 2)
        n = kall.shape[2]
        assert store.n == n and store.open_tokens() == (store.phase + n) % q.k_group
        for gi, (heads, ch) in enumerate(zip(groups.heads, groups.channels, strict=True)):
            want = kept(kall, heads, ch)
            # token j sits in slot phase + j, of K group (phase + j) // k_group; codes [B, Hg, packed c, slot]
            slots = torch.arange(store.phase, store.phase + n)
            codes = store.k_codes[gi][..., slots]
            if q.per_byte == 2:  # channel 2i in the low nibble, 2i + 1 in the high one
                codes = torch.stack([codes & 15, codes >> 4], 3).flatten(2, 3)
            codes = codes[:, :, : ch.shape[1]].float()
            scale = store.k_scale[gi].float()[..., slots // q.k_group]
            got = codes * scale + store.k_min[gi].float()[..., slots // q.k_group]
            err = (got - want.transpose(2, 3)).abs()
            assert bool((err <= scale / 2 * 1.001 + 1e-6).all()), (fmt, n, gi, float(err.max()))
        vq = store.v_codes[:, :, :n].float()
        if q.per_byte == 2:
            vq = torch.stack([vq.long() & 15, vq.long() >> 4], -1).flatten(-2).float()[..., :16]
        vg = store.v_group
        back = (vq.unflatten(-1, (-1, vg)) * store.v_scale[:, :, :n, :, None].float()
                + store.v_min[:, :, :n, :, None].float()).flatten(-2)
        bound = store.v_scale[:, :, :n].float().repeat_interleave(vg, -1) / 2 * 1.001 + 1e-6
        assert bool(((back - vall[:, groups.nonzero_order]).abs() <= bound).all())


# ---- the cache: decode with kv_quant = decode over the dequantised K/V -------------------------------------
@pytest.mark.parametrize("fmt", FORMATS, ids=list(FORMATS))
@pytest.mark.parametrize("rule", ["dense-prompt", "positional"])
@pytest.mark.parametrize("lengths", [[25], [25, 18]], ids=["b1", "b2-pad"])
def test_decode_with_kv_quant_equals_the_rule_over_the_dequantised_kv(fmt, rule, lengths):
    """Step by step (one token, then several at once), the LeanK decode over a quantised middle equals the dense
    LeanK rule (leank_attention) over K/V whose middle tokens are the store's dequantised values, read
    independently; and the store is within its error bound of the real K/V. Both rules, padded rows too."""
    run = _Run(_keep(counts=(0, 5, 8, 3)), lengths, rule=rule)  # odd counts: a half-used int4 byte
    run.layer = LeanKLayer(run.keep, SINK, RECENT, ACCUMU, rule=rule, kv_quant=FORMATS[fmt])
    run.step(max(lengths))
    mids, opened = set(), False
    for q_len in [1] * 9 + [3] + [1] * 7 + [2, 1, 1]:
        out, _ = run.step(q_len)
        assert run.layer._quant is not None
        mids.add(run.layer.mid_len)
        opened |= run.layer._quant.open_tokens() > 0
        if len(lengths) == 1 and ACCUMU % FORMATS[fmt].k_group == 0:  # unpadded, writes after the first: whole groups
            assert run.layer._quant.open_tokens() == 0, "the first write should end on a K group boundary"
        _check_store(run)
        full_k, full_v = run.k, run.v
        run.k, run.v = _with_dequantised_middle(run)
        try:
            ref = run.reference()
        finally:
            run.k, run.v = full_k, full_v
        assert _rel_err(out, ref) < 1e-5, (q_len, run.layer.length)
        assert _rel_err(out, run.reference()) > 1e-6 or run.layer.mid_len == 0  # quantisation did change it
    assert len(mids) >= 4, "the cache never moved tokens to the middle"
    if fmt == "int4-k8" and rule == "dense-prompt":
        assert opened, "a K group larger than accumu_size should have been open at some step"


def test_quantised_middle_survives_beam_reorder_and_growth():
    """reorder/repeat/select map codes, scales, minima and the open group's copy with the rows; growth keeps them."""
    run = _Run(_keep(), [25, 18])
    run.layer = LeanKLayer(run.keep, SINK, RECENT, ACCUMU, kv_quant=FORMATS["int4-k8"])
    run.step(25)
    for _ in range(6):
        run.step(1)
    before, _ = _dequant_store(run.layer)
    run.layer.reorder_cache(torch.tensor([1, 0]))
    after, _ = _dequant_store(run.layer)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a.flip(0), b)
    run.layer.reorder_cache(torch.tensor([1, 0]))
    run.k, run.v = run.k, run.v
    for _ in range(70):  # well past the first capacity
        out, _ = run.step(1)
    full_k, full_v = run.k, run.v
    run.k, run.v = _with_dequantised_middle(run)
    ref = run.reference()
    run.k, run.v = full_k, full_v
    assert _rel_err(out, ref) < 1e-5


# ---- bytes -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS, ids=list(FORMATS))
def test_bytes_equal_the_formula_counted_by_hand(fmt):
    """nbytes: full tokens at the dtype's size, codes (int4: ceil(c / 2) bytes per head and token), a float16 scale
    and minimum per kept channel and K group, per token and V group, and the open group's full-precision copy;
    the same as the one formula (quantized_middle_bytes), step after step."""
    f = FORMATS[fmt]
    keep = _keep(counts=(0, 4, 7, 4))  # an odd count: int4's last byte half used
    layer = LeanKLayer(keep, SINK, RECENT, ACCUMU, kv_quant=f)
    g = torch.Generator().manual_seed(0)
    layer.update(torch.randn(1, HKV, 23, D, generator=g), torch.randn(1, HKV, 23, D, generator=g))
    for step in range(12):
        st = layer._quant
        n, full = layer.mid_len, layer.head_len + layer.tail_len
        kept, nonzero = 15, 3
        codes = n * ((4 + 7 + 4) if f.bits == 8 else (2 + 4 + 2)) + n * nonzero * D * f.bits // 8
        groups = -(-(st.phase + n) // f.k_group)
        params = groups * kept * 2 * 2 + n * nonzero * (D // f.v_group) * 2 * 2
        open_copy = ((st.phase + n) % f.k_group) * kept * 4
        by_hand = full * HKV * 2 * D * 4 + codes + params + open_copy
        assert layer.nbytes() == by_hand, step
        assert quantized_middle_bytes(keep.sum(-1), D, n, groups, (st.phase + n) % f.k_group, f, torch.float32) \
            == by_hand - full * HKV * 2 * D * 4
        layer.update(torch.randn(1, HKV, 1, D, generator=g), torch.randn(1, HKV, 1, D, generator=g))
    assert PARAM_BYTES == 2


@pytest.mark.parametrize("kv_quant", [None, "int8", "int4"])
def test_cache_bytes_after_a_prefill_follow_prefilled_cache_bytes(kv_quant):
    """The reporting formula (bytes per token at a length, dense layers included) is what a LeanKCache holds."""
    keep = torch.stack([_keep(seed=s) for s in range(3)])
    keep[1] = True  # the mask's dense layer
    mask = ChannelMask(keep=keep, sink_size=SINK, recent_size=RECENT, accumu_size=ACCUMU, align=4, dense_layers=(1,))
    cache = LeanKCache(mask, kv_quant=kv_quant)
    for i in range(3):
        cache.update(torch.randn(2, HKV, 150, D), torch.randn(2, HKV, 150, D), i)
    fmt = kq.kv_quant_format(kv_quant)
    assert cache.nbytes() == 2 * prefilled_cache_bytes(mask, 150, torch.float32, fmt)


# ---- the cache's own checks -------------------------------------------------------------------------------
def _filled_layer() -> LeanKLayer:
    layer = LeanKLayer(_keep(), SINK, RECENT, ACCUMU, kv_quant="int4")
    layer.update(torch.randn(1, HKV, 40, D), torch.randn(1, HKV, 40, D))
    layer.layout()  # a healthy cache passes
    return layer


CORRUPTIONS = {
    "k-scale-nan": lambda st: st.k_scale[0].view(-1)[0].fill_(float("nan")),
    "k-scale-inf": lambda st: st.k_scale[1].view(-1)[0].fill_(float("inf")),
    "k-scale-zero": lambda st: st.k_scale[0].view(-1)[1].fill_(0.0),
    "k-scale-negative": lambda st: st.k_scale[0].view(-1)[0].neg_(),
    "v-scale-nan": lambda st: st.v_scale[0, 0, 3].fill_(float("nan")),
    "v-scale-negative": lambda st: st.v_scale[0, 1, 0].fill_(-1.0),
    "k-min-inf": lambda st: st.k_min[0].view(-1)[0].fill_(float("-inf")),
    "v-min-nan": lambda st: st.v_min[0, 0, 0].fill_(float("nan")),
    "k-params-shape": lambda st: setattr(st, "k_params", st.k_params[:, :, :-1]),
    "v-params-dtype": lambda st: setattr(st, "v_params", st.v_params.float()),
    "k-codes-missing": lambda st: st.k_codes.pop(),
    "k-codes-shape": lambda st: st.k_codes.__setitem__(1, st.k_codes[1][:, :, :1]),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=list(CORRUPTIONS))
def test_a_corrupted_scale_is_caught_by_the_cache(corrupt):
    """NaN/inf/zero/negative scales, non-finite minima and tensors of the wrong shape or dtype stop the decode with
    CorruptQuantError, from the layer's own layout() (what every backend reads), not garbage attention."""
    layer = _filled_layer()
    CORRUPTIONS[corrupt](layer._quant)
    with pytest.raises(CorruptQuantError, match="kv_quant cache"):
        layer.layout()


def test_spare_capacity_is_never_read_and_its_parameters_are_checked_too():
    """Codes past the last token change nothing (never read); a NaN scale there is caught like any other."""
    layer = _filled_layer()
    q = torch.randn(1, HKV * 2, 1, D)
    before = torch_decode_attention(q, layer.layout(), DecodeMasks(), D**-0.5)
    st = layer._quant
    assert st.cap > st.n
    st.v_codes[:, :, st.n :] = 255
    for c in st.k_codes:
        c[..., st.phase + st.n :] = 255
    assert torch.equal(before, torch_decode_attention(q, layer.layout(), DecodeMasks(), D**-0.5))
    st.v_scale[:, :, st.n :] = float("nan")
    with pytest.raises(CorruptQuantError, match="V scale"):
        layer.layout()


# ---- the CPU kernel of the quantised middle (leank_infer.decode.quant_cpu) ---------------------------------
KERNEL_CASES = {  # (format, kept counts per KV head, query heads per KV head)
    "int8-k32": (kq.KVQuant("int8", 8, k_group=32), (0, 5, 8, 3), 5),
    "int4-k32": (kq.KVQuant("int4", 4, k_group=32), (0, 5, 8, 3), 5),  # odd counts: a half-used byte
    "int4-k16": (kq.KVQuant("int4", 4, k_group=16), (7, 0, 1, 8), 2),
    "int8-k8": (kq.KVQuant("int8", 8, k_group=8), (3, 3, 0, 6), 3),
    "int4-k4": (kq.KVQuant("int4", 4, k_group=4), (5, 0, 2, 2), 3),  # groups under 8 slots: the scalar loop
}
KD = 40  # head_dim: whole 8-wide vectors and a tail, for int8 and int4 rows alike


def _kernel_layer(case: str, batch: int = 2, prompt: int = 203, steps: int = 10) -> LeanKLayer:
    """A quantised layer after a prefill (a first middle write that does not end on a K group boundary: phase != 0)
    and ``steps`` single-token steps (K groups larger than accumu_size: open groups re-quantised)."""
    fmt, counts, _ = KERNEL_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    keep = torch.zeros(len(counts), KD, dtype=torch.bool)
    for h, c in enumerate(counts):
        keep[h, torch.randperm(KD, generator=g)[:c]] = True
    layer = LeanKLayer(keep, 3, 32, 16, kv_quant=fmt)  # sink 3: a first write of 16k - 3 tokens, phase 3
    kv = lambda m: torch.randn(batch, len(counts), m, KD, generator=g) * 2 + 0.5  # noqa: E731
    layer.update(kv(prompt), kv(prompt), kwargs={})
    for _ in range(steps):
        layer.update(kv(1), kv(1), kwargs={})
    return layer


def _query(case: str, layer: LeanKLayer) -> torch.Tensor:
    g = KERNEL_CASES[case][2] * layer.groups.num_kv_heads
    return torch.randn(layer._quant.batch, g, 1, KD, generator=torch.Generator().manual_seed(7)) * 3


@pytest.mark.parametrize("case", KERNEL_CASES, ids=list(KERNEL_CASES))
def test_the_cpu_kernel_equals_the_pytorch_path_and_the_dequantised_reference(case, monkeypatch):
    """The quantised fast path with the kernel = without it (LEANK_CPU_KERNEL=0) = the fast path over a middle
    dequantised independently (_dequant_store), batch 2, a zero head, odd counts, phase != 0, an open K group."""
    from dataclasses import replace

    from leank_infer.decode import quant_cpu

    assert quant_cpu.available(), "no C++ compiler: the kernel cannot be checked here"
    layer = _kernel_layer(case)
    st = layer._quant
    assert st.phase != 0 and layer.mid_len > 0
    assert st.open_tokens() > 0 or st.fmt.k_group <= 16
    layout, q, scaling = layer.layout(), _query(case, layer), KD**-0.5
    calls = []
    real = quant_cpu.k_scores
    monkeypatch.setattr(quant_cpu, "k_scores", lambda *a: calls.append(1) or real(*a))
    got = torch_decode_attention(q, layout, DecodeMasks(), scaling)
    assert calls, "the kernel was not used"
    ks, vs = _dequant_store(layer)
    ref = torch_decode_attention(q, replace(layout, mid_k=tuple(ks), mid_v=vs, quant=None), DecodeMasks(), scaling)
    monkeypatch.setenv(quant_cpu.ENV_SWITCH, "0")
    torch_path = torch_decode_attention(q, layout, DecodeMasks(), scaling)
    assert len(calls) == sum(1 for c in layer.groups.counts if c)  # the switch: no further kernel call
    assert _rel_err(got, ref) < 2e-6 and _rel_err(torch_path, ref) < 2e-6, (_rel_err(got, ref), _rel_err(torch_path, ref))
    assert _rel_err(got, torch_path) < 2e-6
    assert _rel_err(ref, torch_decode_attention(q, layer.layout().dequantized(), DecodeMasks(), scaling)) < 2e-6


@pytest.mark.parametrize("case", ["int8-k32", "int4-k32", "int4-k4"])
def test_the_cpu_kernel_gives_the_same_bits_at_any_thread_count(case, monkeypatch):
    """Scores and V parts of one layer, at 1 and 2 threads, with pieces of 32 tokens (many per head): equal to the
    bit; and close to one piece per head (the pieces' partial sums merge in a fixed order)."""
    from leank_infer.decode import quant_cpu

    assert quant_cpu.available()
    layer = _kernel_layer(case, prompt=300)
    layout, quant = layer.layout(), layer.layout().quant
    b, n, hkv = quant.v_scale.shape[0], layout.mid_len, layer.groups.num_kv_heads
    g = KERNEL_CASES[case][2]
    gen = torch.Generator().manual_seed(3)
    p = torch.rand(b, hkv, g, n + 5, generator=gen)[..., 5:]  # tokens along memory, not contiguous rows
    outs = []
    for split, threads in [(32, 1), (32, 2), (4096, 1)]:
        monkeypatch.setattr(quant_cpu, "SPLIT", split)
        torch.set_num_threads(threads)
        out = torch.ones(b, hkv, g, KD)
        quant_cpu.v_add(p, layout.mid_v, quant.v_scale, quant.v_min, layer.groups.v_rows(), quant.fmt, out)
        scores = []
        for gi, c in enumerate(layer.groups.counts):
            s = torch.full((b, len(layer.groups.heads[gi]), g, n), float("nan"))
            q = torch.randn(b, s.shape[1], g, c, generator=torch.Generator().manual_seed(gi))
            quant_cpu.k_scores(q, layout.mid_k[gi], quant.k_scale[gi], quant.k_min[gi], quant.phase, quant.fmt, 0.5, s)
            assert not s.isnan().any(), "a middle token's score was not written"
            scores.append(s)
        outs.append((out, *scores))
    torch.set_num_threads(1)
    assert all(torch.equal(x, y) for x, y in zip(outs[0], outs[1], strict=True))
    assert all(_rel_err(x, y) < 1e-5 for x, y in zip(outs[0], outs[2], strict=True))  # fp32 sums, another order
    zero = [h for h in range(hkv) if not layer.groups.keep[h].any()]
    assert zero and bool((outs[0][0][:, zero] == 1).all()), "a head without a middle was written"


def test_a_left_padded_batch_takes_the_general_path_not_the_kernel(monkeypatch):
    """With left padding a row's head keys can be its middle keys (masks not trivial): the kernel, which reads the
    middle alone, is not called; the step dequantises and still equals the rule over the dequantised K/V."""
    from leank_infer.decode import quant_cpu

    fmt = kq.KVQuant("int8", 8, k_group=16, v_group=D)  # one V scale per token: what the kernel reads
    run = _Run(_keep(counts=(0, 5, 8, 3)), [25, 18])
    run.layer = LeanKLayer(run.keep, SINK, RECENT, ACCUMU, kv_quant=fmt)
    monkeypatch.setattr(quant_cpu, "k_scores", lambda *a: pytest.fail("the kernel was called"))
    run.step(25)
    for _ in range(12):
        out, _ = run.step(1)
    assert run.layer.padded and run.layer.mid_len > 0
    full_k, full_v = run.k, run.v
    run.k, run.v = _with_dequantised_middle(run)
    ref = run.reference()
    run.k, run.v = full_k, full_v
    assert _rel_err(out, ref) < 1e-5


def test_without_a_compiler_the_quantised_decode_falls_back_once_logged(monkeypatch, tmp_path, caplog):
    """No compiler (CXX=false): the kernel is off with one warning, and the decode is the PyTorch path's."""
    from leank_infer.decode import quant_cpu

    layer = _kernel_layer("int4-k32", steps=3)
    q = _query("int4-k32", layer)
    monkeypatch.setattr(quant_cpu.LIBRARY, "tried", False)
    monkeypatch.setattr(quant_cpu.LIBRARY, "lib", None)
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("LEANK_CACHE", str(tmp_path))
    monkeypatch.setattr(quant_cpu, "k_scores", lambda *a: pytest.fail("the kernel was called"))
    with caplog.at_level("WARNING", logger=quant_cpu.__name__):
        got = torch_decode_attention(q, layer.layout(), DecodeMasks(), KD**-0.5)
        torch_decode_attention(q, layer.layout(), DecodeMasks(), KD**-0.5)
    assert caplog.text.count("CPU kv_quant kernel is not available") == 1
    assert not list(tmp_path.rglob("*.so"))
    ref = torch_decode_attention(q, layer.layout().dequantized(), DecodeMasks(), KD**-0.5)
    assert _rel_err(got, ref) < 2e-6


KERNEL_ASAN_SCRIPT = r"""
import ctypes, os, sys, torch
sys.path.insert(0, sys.argv[1])
from test_kv_quant import KERNEL_CASES, KD, _kernel_layer, _query, _rel_err
from leank_infer.decode import quant_cpu
from leank_infer.decode.layout import DecodeMasks
from leank_infer.decode.torch_decode import torch_decode_attention
quant_cpu.LIBRARY.use(ctypes.CDLL(sys.argv[2]))
torch.set_num_threads(2)
for case in KERNEL_CASES:
    layer = _kernel_layer(case, batch=2, prompt=290)
    q = _query(case, layer)
    got = torch_decode_attention(q, layer.layout(), DecodeMasks(), KD**-0.5)
    os.environ[quant_cpu.ENV_SWITCH] = "0"
    ref = torch_decode_attention(q, layer.layout(), DecodeMasks(), KD**-0.5)
    os.environ[quant_cpu.ENV_SWITCH] = "1"
    assert _rel_err(got, ref) < 2e-6, case
print("asan ok")
"""


def test_the_cpu_kernel_reads_only_inside_its_buffers_under_address_sanitizer(tmp_path):
    """The kernel built with -fsanitize=address, over every case (whole K groups read around the middle's ends, in
    the last row of the last head of a batch, where the storage ends): an overrun aborts the run."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from leank_infer.decode import quant_cpu

    libasan = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not libasan or not Path(libasan).exists():
        pytest.skip("no AddressSanitizer runtime for g++ here")
    flags = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1", "-fopenmp"]
    lib = quant_cpu.LIBRARY.build(["-march=native", *flags], tmp_path)  # the vector loads of the shipped build
    env = {
        **os.environ,
        "LD_PRELOAD": os.path.realpath(libasan),
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=97",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    r = subprocess.run([sys.executable, "-c", KERNEL_ASAN_SCRIPT, str(Path(__file__).parent), str(lib)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "asan ok" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


# ---- the evaluation's methods ----------------------------------------------------------------------------
def test_quantised_methods_decode_with_their_own_cache(tmp_path):
    """LeanK + kv_quant, random channels + kv_quant and transformers' QuantizedCache (quanto) answer a shared-prefill
    batch exactly as each one's own generate does, prompt by prompt; the answers tell them apart."""
    pytest.importorskip("optimum.quanto")
    from test_eval_scoring import _decode
    from test_model import tiny_repo
    from transformers import QuantizedCache

    from leank_infer import LeanKModel
    from leank_infer.model.generation import CACHE_KWARG
    from leank_train.evaluation.loop import answer_batch
    from leank_train.evaluation.methods import Learned, QuantizedKV, RandomChannels, random_mask_like

    scores = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(1))
    mask = ChannelMask.from_scores(scores, 0.75, 4, sink_size=4, recent_size=8, accumu_size=4)
    mask_dir, _ = tiny_repo(tmp_path, family="qwen3", mask=mask)
    lm = LeanKModel.from_pretrained(mask_dir)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (96, 71)]
    methods = [Learned(), Learned("leank-int4", kv_quant="int4"), RandomChannels("random-int8", seed=7, kv_quant="int8"),
               QuantizedKV("quanto-int2", "quanto", 2, group=16)]
    got = answer_batch(lm, methods, prompts, [12, 12])
    rnd = random_mask_like(lm.mask, seed=7)
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        gen = dict(max_new_tokens=12, do_sample=False)
        own = {
            "leank": _decode(lm, lm.mask, inputs, 12),
            "leank-int4": LeanKModel(lm.model, lm.mask, lm.tokenizer, kv_quant="int4").generate(**inputs, **gen),
            "random-int8": LeanKModel(lm.model, rnd, lm.tokenizer, kv_quant="int8").generate(**inputs, **gen),
        }
        with lm.dense():
            cache = QuantizedCache("quanto", lm.model.config, nbits=2, q_group_size=16)
            own["quanto-int2"] = lm.model.generate(**inputs, **gen, **{CACHE_KWARG: cache})
        for name, out in own.items():
            want = out if isinstance(out, str) else lm.tokenizer.decode(out[0, len(p):], skip_special_tokens=True)
            assert got[name][i] == want, (name, i)
    assert len({got[m.name][0] for m in methods}) >= 3, got  # quantised and not are told apart


def test_quantized_cache_bytes_follow_the_formula():
    """hf_quantized_cache_bytes counts what quanto stores: 4-bit codes two a byte, a scale and a shift (model dtype)
    per 64 values, the prompt quantised whole at the first update."""
    pytest.importorskip("optimum.quanto")
    from transformers import LlamaConfig, QuantizedCache

    from leank_infer.mask.kv_bytes import hf_quantized_cache_bytes

    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=128, head_dim=64)
    for bits in (4, 2):
        cache = QuantizedCache("quanto", cfg, nbits=bits)
        for i in range(2):
            cache.update(torch.randn(1, 2, 200, 64), torch.randn(1, 2, 200, 64), i)
        held = 0
        for layer in cache.layers:
            for q in (layer._quantized_keys, layer._quantized_values):
                held += q._data._data.numel() + (q._scale.numel() + q._shift.numel()) * 4
        assert held == hf_quantized_cache_bytes(2, 2, 64, 200, bits, torch.float32)


# ---- cards and figure -----------------------------------------------------------------------------------
def test_card_says_which_quantisation_each_method_was_evaluated_with(tmp_path):
    """The Results section says the LeanK rows' kv_quant; the KV quantisation section lists each method with its
    kv_quant, bytes and headline, under the command that measured them; earlier results are kept; the Pareto
    figure is drawn from the same numbers."""
    from test_card import _mask_dir

    from leank_infer.hub.card import write_model_card
    from leank_infer.hub.plots import plot_pareto

    _mask_dir(tmp_path)
    rows = [{"dataset": "needle-2k", "value": 0.75, "command": "leank eval x", "metric": "accuracy (leank)",
             "metric_args": {"method": "leank", "kv_quant": "int8"}}]
    write_model_card(tmp_path, eval_results=rows)
    assert "kv_quant of the LeanK rows: int8." in (tmp_path / "README.md").read_text()
    res = {"methods": ["full", "leank-r70", "leank-r70-int4", "quanto-int4"], "lengths": [1024], "bytes_at": 8192,
           "bytes_per_token": {"full": 23040, "leank-r70": 8844, "leank-r70-int4": 2756, "quanto-int4": 6480},
           "headline": {1024: {m: {"score": s, "se": 0.02} for m, s in
                               zip(["full", "leank-r70", "leank-r70-int4", "quanto-int4"], [0.93, 0.92, 0.9, 0.85],
                                   strict=True)}}}
    png = plot_pareto(res, tmp_path.parent / f"{tmp_path.name}-fig" / "pareto.png", "python benchmarks/eval_masks.py x")
    assert png.read_bytes()[:4] == b"\x89PNG"
    record = {"command": "python benchmarks/eval_masks.py x --kv-quants int4", "lengths": [1024], "bytes_at": 8192,
              "rows": [{"method": "LeanK", "name": "leank-r70-int4", "kv_quant": "int4", "bytes_per_token": 2756.0,
                        "headline": {"1024": "0.900 +/- 0.020"}}],
              "samples_per_task": 4, "headline_tasks": {"1024": ["passkey", "niah_single_number"]}}
    write_model_card(tmp_path, None, figures={"pareto.png": record["command"]}, figure_files=[png], kv_quant=record)
    text = (tmp_path / "README.md").read_text()
    assert "## KV quantisation" in text and "| LeanK | int4 | 2,756 | 0.900 +/- 0.020 |" in text
    assert "kv_quant of the LeanK rows: int8." in text  # the earlier results stay
    assert (tmp_path / "pareto.png").is_file() and "python benchmarks/eval_masks.py x --kv-quants int4" in text
    assert "4 probes per task and length" in text and "1024 tokens: passkey, niah_single_number" in text
    # several runs (one per length): one table, a column per length, the commands listed under it in that order
    second = {**record, "command": "python benchmarks/eval_masks.py y --lengths 2048", "lengths": [2048],
              "rows": [{**record["rows"][0], "headline": {"2048": "0.800 +/- 0.030"}}],
              "headline_tasks": {"2048": ["passkey"]}}
    write_model_card(tmp_path, None, kv_quant=[record, second])
    text = (tmp_path / "README.md").read_text()
    assert text.count("## KV quantisation") == 1
    row = text.index("| LeanK | int4 | 2,756 | 0.900 +/- 0.020 | 0.800 +/- 0.030 |")
    assert row < text.index("1. 1,024 tokens: <code>python benchmarks/eval_masks.py x --kv-quants int4</code>") < text.index(
        "2. 2,048 tokens: <code>python benchmarks/eval_masks.py y --lengths 2048</code>")


@pytest.mark.parametrize("bad, says", [
    ("nope", "must be a run record or a list"),
    ([{"lengths": [1024], "bytes_at": 8192, "rows": []}], "record 0 has no 'command'"),
    ({"command": "x", "lengths": ["1k"], "bytes_at": 8192, "rows": []}, "'lengths' list of integers"),
    ({"command": "x", "lengths": [1024], "bytes_at": 8192, "rows": [{"method": "LeanK"}]}, "rows without"),
])
def test_a_damaged_kv_quant_record_is_named_before_the_card_is_drawn(tmp_path, bad, says):
    """eval.json's kv_quant from a stranger: one MaskError naming it, and the folder left as it was."""
    import json

    from test_card import _mask_dir

    from leank_infer.hub.card import write_model_card
    from leank_infer.mask import MaskError

    _mask_dir(tmp_path)
    (tmp_path / "eval.json").write_text(json.dumps({"kv_quant": bad}))
    before = {f.name: f.read_bytes() for f in tmp_path.iterdir()}
    with pytest.raises(MaskError, match=says):
        write_model_card(tmp_path, None)
    assert {f.name: f.read_bytes() for f in tmp_path.iterdir()} == before


def test_command_lines_take_kv_quant():
    """--kv-quant int8/int4 on leank bench, eval and generate; anything else is one clear usage error."""
    from leank_infer.bench import bench
    from leank_infer.cli import parse
    from leank_infer.cli_types import UsageError
    from leank_infer.generate_cli import generate
    from leank_train.evaluate import eval_command

    for func, argv in ((bench, []), (generate, ["m", "--prompt", "x"]), (eval_command, ["m"])):
        assert parse(func, [*argv, "--kv-quant", "int4"], "leank x")["kv_quant"] == "int4"
        assert parse(func, argv, "leank x")["kv_quant"] is None
        with pytest.raises(UsageError, match="kv_quant"):
            parse(func, [*argv, "--kv-quant", "int3"], "leank x")
    with pytest.raises(ValueError, match="kv_quant must be one of"):
        LeanKCache(ChannelMask(keep=_keep()[None], sink_size=SINK, recent_size=RECENT, accumu_size=ACCUMU, align=4),
                   kv_quant="fp8")
