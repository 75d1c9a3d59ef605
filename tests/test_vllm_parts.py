"""The vLLM plugin's torch-only parts (rule, page layout, settings): run in every environment."""

from __future__ import annotations

import re

import pytest
import torch

from leank_infer import MaskError
from leank_infer.decode.cache import LeanKLayer
from leank_infer.decode.rule import positional_recent_from
from leank_infer.vllm.layout import PackedLayout
from leank_infer.vllm.settings import ENV_MASK, LeanKSettings, settings_from


@pytest.mark.parametrize("prefill", [1, 5, 20, 23, 40])
def test_recent_start_follows_the_hf_cache(prefill):
    """The rule's recent start from the position alone is the HF cache layer's at every decode step (whatever the
    prompt's length)."""
    sink, recent, accumu = 4, 8, 3
    layer = LeanKLayer(torch.ones(2, 8, dtype=torch.bool), sink, recent, accumu)
    layer.update(torch.randn(1, 2, prefill, 8), torch.randn(1, 2, prefill, 8))
    for length in range(prefill, prefill + 30):
        layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
        assert layer.recent_start == positional_recent_from(length, recent, accumu), length


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
    """A request's K/V in shuffled pages plus the dense reference inputs: 4 KV heads x 2 queries, one head keeping nothing
    (the Triton paged kernel's test case, tests/test_vllm_triton_paged.py)."""
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


@pytest.mark.parametrize(
    "device, kv_dtype, refused",
    [
        ("cpu", "auto", None),
        ("cpu", "bfloat16", None),  # fp32 weights, bf16 pages: the CPU kernels convert
        ("cpu", "float16", None),
        ("cuda", "fp8", None),
        ("cuda", "bfloat16", "kv_cache_dtype='bfloat16' (LeanK stores K/V in the model dtype or fp8; float16 or bf"),
        ("cuda", "float32", None),  # the model's own dtype, spelt out
        ("cpu", "fp8_inc", "kv_cache_dtype='fp8_inc' (LeanK stores K/V in the model dtype or fp8)"),
    ],
)
def test_a_two_byte_kv_dtype_is_served_on_the_cpu_build_only(device, kv_dtype, refused):
    """The engine check (fp32 weights): the model's dtype (``auto`` or named) or fp8 everywhere, float16/bfloat16
    pages on the CPU build (its write rounds, its decode reads them; the Triton kernels' conversions are untried),
    nothing else."""
    from types import SimpleNamespace

    from leank_infer.vllm.settings import check_engine

    config = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=kv_dtype), device_config=SimpleNamespace(device_type=device),
        model_config=SimpleNamespace(dtype=torch.float32),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1), speculative_config=None,
    )  # fmt: skip
    if refused is None:
        check_engine(config)
    else:
        with pytest.raises(MaskError, match=re.escape(refused)):
            check_engine(config)
