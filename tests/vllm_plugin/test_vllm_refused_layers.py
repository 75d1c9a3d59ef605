"""A full-attention layer that needs what the LeanK kernels do not apply is refused at start with one error naming
it: attention-logit soft-capping (Gemma 2), ALiBi biases (Bloom, MPT) and attention sinks (gpt-oss). Served anyway,
its tokens would silently differ from the model's. Without a mask vLLM's own attention runs such a layer."""

from __future__ import annotations

import pytest
import torch

from .conftest import ENGINE, MASK

LAYER = dict(num_heads=9, head_size=64, scale=0.125, num_kv_heads=3, alibi_slopes=None, sliding_window=None,
             kv_cache_dtype="auto")  # fmt: skip
REFUSED = [
    ({"logits_soft_cap": 50.0}, "attention logit soft-capping (cap 50.0)"),
    ({"alibi_slopes": [2.0 ** -(i + 1) for i in range(9)]}, "ALiBi position biases"),
    ({"sinks": torch.zeros(9)}, "attention sinks"),
]


def _config(model_dir, additional: dict):  # noqa: ANN001, ANN202
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model_dir), additional_config=additional, **ENGINE).create_engine_config()


@pytest.mark.parametrize(("extra", "named"), REFUSED, ids=["softcap", "alibi", "sinks"])
def test_a_layer_leanks_kernels_cannot_run_exactly_is_refused_by_name(model_dir, extra, named):
    from vllm.config import set_current_vllm_config

    from leank_infer.mask import MaskError
    from leank_infer.vllm.backend import LeanKCPUAttentionImpl

    with set_current_vllm_config(_config(model_dir, {"leank_mask": MASK})):
        assert LeanKCPUAttentionImpl(**LAYER).mask is not None  # the same layer without it: LeanK's
        with pytest.raises(MaskError, match="LeanK serving does not support") as refused:
            LeanKCPUAttentionImpl(**{**LAYER, **extra})
    assert named in str(refused.value) and "full-attention layers" in str(refused.value)
    assert [what for _, what in REFUSED if what in str(refused.value)] == [named]  # and nothing else


@pytest.mark.parametrize(("extra", "named"), REFUSED, ids=["softcap", "alibi", "sinks"])
def test_without_a_mask_vllms_attention_runs_those_layers(model_dir, extra, named):
    from vllm.config import set_current_vllm_config

    from leank_infer.vllm.backend import LeanKCPUAttentionImpl

    with set_current_vllm_config(_config(model_dir, {})):
        assert LeanKCPUAttentionImpl(**{**LAYER, **extra}).mask is None
