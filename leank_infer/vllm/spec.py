"""Per-layer KV cache specs for LeanK layers: the one place the plugin wraps a vLLM method.

vLLM lets an attention backend adjust a layer's KV cache spec (``AttentionBackend.customize_spec``),
but that hook sees the spec, not the layer, and a LeanK page differs per layer (each layer keeps
its own channels). So :func:`install` wraps ``Attention.get_kv_cache_spec``: a layer whose
implementation is LeanK's gets its packed page size; any other full-attention decoder layer of an
engine that names a LeanK mask is an error (a LeanK backend is not what runs it: on a GPU, another
attention backend than ``TRITON_ATTN`` was chosen), raised before the KV pool is allocated. vLLM then groups
the layers itself (same type, different page sizes: ``UniformTypeKVCacheSpecs``).
"""

from __future__ import annotations

from typing import Any

from ..mask import MaskError
from .settings import settings_from

_installed = False


def install() -> None:
    """Wrap ``Attention.get_kv_cache_spec`` once per process."""
    global _installed
    if _installed:
        return
    from vllm.model_executor.layers.attention import Attention

    original = Attention.get_kv_cache_spec

    def get_kv_cache_spec(self: Any, vllm_config: Any) -> Any:
        spec = original(self, vllm_config)
        leank = getattr(getattr(self, "impl", None), "leank_kv_cache_spec", None)
        if leank is not None and getattr(self.impl, "mask", None) is not None:
            return leank(self.layer_name, spec)
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        if (
            type(spec) is FullAttentionSpec
            and leank is None
            and settings_from(getattr(vllm_config, "additional_config", None)) is not None
        ):
            raise MaskError(
                f"a LeanK mask is set but layer {self.layer_name} runs {type(self.impl).__name__}: LeanK runs in "
                "vLLM's CPU_ATTN backend (CPU build) and TRITON_ATTN (GPUs: pass --attention-backend TRITON_ATTN)"
            )
        return spec

    Attention.get_kv_cache_spec = get_kv_cache_spec
    _installed = True
