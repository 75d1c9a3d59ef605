"""Per-layer KV cache specs for LeanK layers: the one place the plugin wraps a vLLM method.

vLLM lets an attention backend adjust a layer's KV cache spec, but not per layer: in vLLM 0.32
``AttentionBackend.customize_spec(cls, spec)`` (``vllm/v1/attention/backend.py``) is a classmethod
that gets only the spec. Its caller, ``customize_attention_spec(backend, spec)``
(``vllm/v1/worker/utils.py``), is called from ``GPUModelRunner.get_kv_cache_spec`` (which the CPU
runner inherits) and from ``vllm/v1/worker/gpu/attn_utils.py``, each with the layer name and module
in hand but not passed on; and every layer of a model shares one backend class. A LeanK page
differs per layer (each layer keeps its own channels), so the missing interface is a per-layer
one: the layer (its name or module) passed to ``customize_spec``, or an implementation-level hook
such as ``AttentionImpl.get_kv_cache_spec(layer_name, spec)``. (The hook's own docstring calls it
temporary: the stated end state, vLLM issue 42449, is backends building the spec themselves.)

Until then :func:`install` wraps ``Attention.get_kv_cache_spec``: a layer whose implementation is
LeanK's gets its packed page size; any other full-attention decoder layer of an engine that names a
LeanK mask is an error (a LeanK backend is not what runs it: on a GPU, another attention backend
than ``TRITON_ATTN`` was chosen), raised before the KV pool is allocated. vLLM then groups the layers
itself (same type, different page sizes: ``UniformTypeKVCacheSpecs``).
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
