"""Planning a worker's LeanK pages inside vLLM: every decoder layer must be LeanK's once a mask is set."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402

from leank_infer import ChannelMask, MaskError  # noqa: E402
from leank_infer.vllm.backend import LeanKCPUAttentionImpl, plan_worker  # noqa: E402


def layer(impl: object) -> Attention:
    """An attention layer as the static forward context holds it (no model needed to check the wiring)."""
    module = object.__new__(Attention)
    object.__setattr__(module, "attn_type", AttentionType.DECODER)
    object.__setattr__(module, "impl", impl)
    return module


def test_a_layer_another_backend_runs_is_refused_while_a_mask_is_set():
    """A GPU engine that picked another attention backend than TRITON_ATTN would serve dense attention
    with dense pages, silently: planning refuses it, naming the layer."""
    mask = ChannelMask.full(2, 3, 64)
    leank = object.__new__(LeanKCPUAttentionImpl)
    leank.mask, leank.slot, leank.num_kv_heads, leank.head_size = mask, None, 3, 64
    other = SimpleNamespace(mask=None)  # e.g. FlashAttentionImpl
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(
            static_forward_context={"model.layers.0.self_attn.attn": layer(leank), "model.layers.1.self_attn.attn": layer(other)}
        )
    )
    with pytest.raises(MaskError, match="layer model.layers.1.self_attn.attn runs SimpleNamespace"):
        plan_worker(config, mask)
