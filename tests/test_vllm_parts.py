"""The vLLM plugin's torch-only parts (rule, page layout, settings): run in every environment."""

from __future__ import annotations

import pytest
import torch

from leank_infer import MaskError
from leank_infer.decode.cache import LeanKLayer
from leank_infer.decode.rule import recent_from
from leank_infer.vllm.layout import PackedLayout
from leank_infer.vllm.settings import ENV_MASK, LeanKSettings, settings_from


@pytest.mark.parametrize("prefill", [1, 5, 20, 23, 40])
def test_recent_start_follows_the_hf_cache(prefill):
    """The rule's closed form (what the vLLM backend calls) gives the HF cache layer's recent start at every decode step."""
    sink, recent, accumu = 4, 8, 3
    layer = LeanKLayer(torch.ones(2, 8, dtype=torch.bool), sink, recent, accumu)
    layer.update(torch.randn(1, 2, prefill, 8), torch.randn(1, 2, prefill, 8))
    for length in range(prefill, prefill + 30):
        layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
        assert layer.recent_start == recent_from(prefill, length, recent, accumu), length


def test_packed_rows_hold_kept_k_and_v_of_heads_keeping_any():
    keep = torch.zeros(3, 8, dtype=torch.bool)
    keep[0, [1, 4]] = True
    keep[2] = True  # head 1 keeps nothing: no K, no V
    layout = PackedLayout.from_keep(keep)
    assert layout.width == 2 + 8 + 2 * 8
    assert layout.head_has_middle.tolist() == [True, False, True]
    k, v = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    rows = layout.pack(k, v)
    assert rows.shape == (5, layout.width)
    uk, uv = layout.unpack(rows)
    torch.testing.assert_close(uk, k * keep)
    torch.testing.assert_close(uv, v * keep.any(-1)[:, None])


def test_a_layer_keeping_nothing_still_has_a_page_row():
    layout = PackedLayout.from_keep(torch.zeros(2, 4, dtype=torch.bool))
    assert layout.width == 1 and layout.bytes_per_token(torch.float32) == 4
    assert layout.pack(torch.randn(3, 2, 4), torch.randn(3, 2, 4)).shape == (3, 1)
    assert not layout.head_has_middle.any()


def test_settings_come_from_additional_config_or_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_MASK, raising=False)
    assert settings_from({}) is None and settings_from(None) is None
    assert settings_from({"leank_mask": "org/m", "leank_mask_revision": "v1"}) == LeanKSettings("org/m", "v1")
    monkeypatch.setenv(ENV_MASK, "hub/x")
    assert settings_from({}) == LeanKSettings("hub/x")
    with pytest.raises(MaskError, match="unknown LeanK setting"):
        settings_from({"leank_mask": "a", "leank_ratio": 0.5})
    with pytest.raises(MaskError, match="true or false"):
        settings_from({"leank_mask": "a", "leank_check_base_model": "no"})


def paged_case(dtype=torch.float32, seed=0, n_tokens=150, block_size=16):
    """A request's K/V in shuffled pages plus the dense reference inputs: 4 KV heads x 2 queries, one head keeping nothing."""
    g = torch.Generator().manual_seed(seed)
    hkv, grp, d = 4, 2, 32
    keep = torch.rand(hkv, d, generator=g) < 0.3
    keep[1] = False  # a head with no middle keys
    keep[3, :] = True  # a head keeping every channel
    layout = PackedLayout.from_keep(keep)
    k = torch.randn(n_tokens, hkv, d, generator=g)
    v = torch.randn(n_tokens, hkv, d, generator=g)
    q = torch.randn(hkv * grp, d, generator=g)
    nblocks = -(-n_tokens // block_size)
    block_row = torch.randperm(nblocks + 5, generator=g)[:nblocks].int()  # the request's blocks, scattered
    pages = torch.zeros(nblocks + 5, block_size, layout.width)
    pos = torch.arange(n_tokens)
    slots = block_row.long()[pos // block_size] * block_size + pos % block_size
    pages.view(-1, layout.width)[slots] = layout.pack(k, v)
    cast = lambda t: t.to(dtype)  # noqa: E731
    return keep, layout, cast(q), cast(k), cast(v), cast(pages), block_row


def dense_leank(q, k, v, keep, sink, mid_end, scale):
    """The LeanK rule written densely: middle keys [sink, mid_end) with kept channels only, heads keeping none skip them."""
    q, k, v = q.double(), k.double(), v.double()
    hkv, d = keep.shape
    grp = q.shape[0] // hkv
    out = []
    for h in range(hkv):
        kk = k[:, h].clone()
        kk[sink:mid_end] *= keep[h]
        s = q[h * grp : (h + 1) * grp] @ kk.t() * scale
        if not keep[h].any():
            s[:, sink:mid_end] = float("-inf")
        out.append(torch.softmax(s, -1) @ v[:, h])
    return torch.cat(out)


@pytest.mark.parametrize("mid", [(16, 100), (16, 16), (3, 149)])
def test_paged_decode_equals_the_dense_rule(mid):
    """Middle keys read from shuffled packed pages give the LeanK rule's attention (fp32 vs fp64 dense)."""
    from leank_infer.vllm.paged_decode import paged_decode

    sink, mid_end = mid
    keep, layout, q, k, v, pages, block_row = paged_case()
    full = torch.cat([torch.arange(sink), torch.arange(mid_end, k.shape[0])])
    got = paged_decode(q, k[full], v[full], pages, block_row, sink, mid_end, layout, 0.125)
    # the dense rule over the same keys, in position order (the softmax does not care about order)
    want = dense_leank(q, k, v, keep, sink, mid_end, 0.125)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def batch_case(hkv=4, grp=2, d=32, bs=16, seed=3, align=1):
    """Three requests of different lengths in one shuffled pool (one head keeps nothing): the batched
    inputs and each request's dense-rule answer. ``align``: kept channels per head are a multiple of it."""
    g = torch.Generator().manual_seed(seed)
    sink = 5
    keep = torch.rand(hkv, d, generator=g) < 0.3
    if align > 1:
        keep = torch.zeros(hkv, d, dtype=torch.bool)
        for h in range(hkv):
            keep[h, torch.randperm(d, generator=g)[: align * (1 + h % (d // align))]] = True
    keep[1] = False
    layout = PackedLayout.from_keep(keep)
    lengths, mid_ends = [150, 61, 40], [100, 45, 5]  # the last one has no middle key at all
    nblocks = sum(-(-n // bs) for n in lengths)
    order = torch.randperm(nblocks + 3, generator=g)
    pages = torch.randn(nblocks + 3, bs, layout.width, generator=g)  # unused slots hold other finite rows
    table = torch.zeros(3, -(-max(lengths) // bs), dtype=torch.int32)
    qs, fks, fvs, wants = [], [], [], []
    used = 0
    for i, (n, end) in enumerate(zip(lengths, mid_ends, strict=True)):
        k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        q = torch.randn(hkv * grp, d, generator=g)
        nb = -(-n // bs)
        table[i, :nb] = order[used : used + nb].int()
        used += nb
        pos = torch.arange(n)
        pages.view(-1, layout.width)[table[i].long()[pos // bs] * bs + pos % bs] = layout.pack(k, v)
        full = torch.cat([torch.arange(sink), torch.arange(max(end, sink), n)])
        qs.append(q), fks.append(k[full]), fvs.append(v[full])
        wants.append(dense_leank(q, k, v, keep, sink, max(end, sink), 0.125))
    full_k = torch.nn.utils.rnn.pad_sequence(fks, batch_first=True)
    full_v = torch.nn.utils.rnn.pad_sequence(fvs, batch_first=True)
    full_len = torch.tensor([t.shape[0] for t in fks])
    args = (torch.stack(qs), full_k, full_v, full_len, pages, table, sink, mid_ends, layout, 0.125)
    return args, wants


def test_paged_decode_batch_equals_each_request_alone():
    """One batched call over requests of different lengths: each equals the dense rule alone (padding of the
    shorter requests' full keys and middle blocks gets no weight)."""
    from leank_infer.vllm.paged_decode import paged_decode_batch

    args, wants = batch_case()
    got = paged_decode_batch(*args)
    for i in range(3):
        torch.testing.assert_close(got[i].double(), wants[i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "shape",
    [dict(), dict(hkv=3, grp=3, d=64, bs=128, align=16), dict(align=8), dict(grp=9, d=32), dict(d=24, bs=8)],
    ids=["g2-d32", "smollm2-shape-aligned", "g2-aligned", "generic-group", "generic-dim"],
)
def test_cpu_kernel_equals_the_torch_path_and_the_rule(shape):
    """The fused C kernel (vectorised paths for D % 16 == 0, kept channels % 8 == 0 and G <= 8, plain loops
    otherwise) against the
    PyTorch batch path and the dense rule, on the same shuffled pool."""
    from leank_infer.vllm import cpu_kernel
    from leank_infer.vllm.paged_decode import paged_decode_batch

    if not cpu_kernel.available():
        pytest.skip("no working C compiler here: the backend keeps the PyTorch path")
    args, wants = batch_case(**shape)
    got = cpu_kernel.cpu_paged_decode_batch(*args)
    torch.testing.assert_close(got, paged_decode_batch(*args), atol=1e-5, rtol=1e-5)
    for i in range(3):
        torch.testing.assert_close(got[i].double(), wants[i], atol=1e-5, rtol=1e-5)


def test_cpu_kernel_switch_and_failed_build_fall_back(monkeypatch, tmp_path, caplog):
    """LEANK_VLLM_CPU_KERNEL=0 turns the kernel off; a compiler that fails is logged and leaves it off."""
    from leank_infer.vllm import cpu_kernel

    monkeypatch.setenv(cpu_kernel.ENV_SWITCH, "0")
    assert not cpu_kernel.available()
    monkeypatch.delenv(cpu_kernel.ENV_SWITCH)
    monkeypatch.setattr(cpu_kernel, "_tried", False)
    monkeypatch.setattr(cpu_kernel, "_lib", None)
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("LEANK_CACHE", str(tmp_path))
    with caplog.at_level("WARNING", logger=cpu_kernel.__name__):
        assert not cpu_kernel.available()
    assert "building the vLLM CPU decode kernel failed" in caplog.text
    assert not list(tmp_path.rglob("*.so"))
