"""LeanK attention for vLLM: every K/V byte in vLLM's pool, the positional rule, batched decode.

Registered by :func:`leank_infer.vllm.register` in place of ``CPU_ATTN`` (vLLM's CPU build) and
``TRITON_ATTN`` (CUDA, which vLLM's selection then gives every decoder layer, no flag needed:
:mod:`~leank_infer.vllm.backend_cuda`): without a LeanK mask in the engine's settings every layer is vLLM's
own attention, unchanged. With one, each decoder layer of the model is a LeanK layer:

- its K/V live in the worker's LeanK pages (:mod:`~leank_infer.vllm.pool`): packed rows for every
  token, full rows for the sink and the window. The layer shares the packed store's cache and block
  table (vLLM's cross-layer KV sharing) and reads its window store's metadata from the forward
  context. vLLM sizes, counts ("KV cache size: N tokens"), frees, caches and preempts all of it;
- a prompt query attends to the prompt with every channel, and every generated query follows the positional
  rule (:func:`~leank_infer.decode.rule.positional_recent_from`): the ``"dense-prompt"`` rule, the default
  (``leank_rule: "positional"`` makes prompt queries follow the positional rule too). The outcome depends on
  positions and the prompt's length only, so chunked prefill, prefix-cache hits and preemption give the
  tokens an unchunked, uncached, uninterrupted run gives (up to floating point), and so does
  ``LeanKModel(..., rule=...)`` with the same rule;
- the decode requests of a step (one new token each; vLLM puts them first) go to one kernel call per
  layer (:mod:`~leank_infer.vllm.kernels`); each prefill chunk gathers its request's K/V from the pages and
  runs SDPA: dense over the prompt's full rows for prompt queries (:func:`~leank_infer.vllm.kernels.dense_prefill`),
  the positional prefill for the others (:func:`~leank_infer.vllm.kernels.prefill`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from ..mask import ChannelMask, MaskError
from . import kernels
from .paged_reference import request_kv
from .pool import DEFAULT_BLOCK_SIZE, PACKED_SUFFIX, WINDOW_SUFFIX, LayerSlot, WorkerPlan, kv_specs
from .settings import load_checked_mask, settings_from
from .stores import PackedBackend, Store, WindowBackend

_NO_WINDOW = (-1, None, (-1, -1))  # how vLLM's CPU and Triton implementations spell "no sliding window"
_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def check_engine(vllm_config: Any) -> None:
    """Refuse engine settings the LeanK backend does not implement (one error naming each)."""
    problems = []
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None and getattr(spec, "num_speculative_tokens", None):
        problems.append("speculative decoding")
    dtype = vllm_config.cache_config.cache_dtype
    if dtype not in ("auto", None, *_FP8):
        problems.append(f"kv_cache_dtype={dtype!r} (LeanK stores K/V in the model dtype or fp8)")
    if vllm_config.parallel_config.decode_context_parallel_size > 1:
        problems.append("decode context parallelism")
    if problems:
        raise MaskError("LeanK serving does not support " + "; ".join(problems))


class LeanKAttentionMixin:
    """LeanK attention over a vLLM attention implementation (the next class in the MRO), which runs
    every layer when the engine names no mask."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mask: ChannelMask | None = None
        self.slot: LayerSlot | None = None
        self.view_slot: LayerSlot | None = None  # the slot over this layer's own views of the pages
        self.plan: WorkerPlan | None = None
        self.window_name: str | None = None
        self.fp8: torch.dtype | None = None
        self.dense_prompt = False
        config = get_current_vllm_config()
        self.vllm_config = config
        settings = settings_from(getattr(config, "additional_config", None))
        if settings is None or self.attn_type != AttentionType.DECODER:
            return  # vLLM's own attention
        if self.sliding_window not in _NO_WINDOW:
            raise MaskError(
                "LeanK serving does not support models with sliding-window attention layers "
                f"(this layer's window: {self.sliding_window})"
            )
        check_engine(config)
        self.check_platform(config)
        self.mask = load_checked_mask(settings, config.model_config.hf_config, config.model_config.model)
        self.fp8 = _FP8.get(config.cache_config.cache_dtype)
        self.dense_prompt = settings.dense_prompt

    def check_platform(self, vllm_config: Any) -> None:
        """Refuse what this implementation cannot run (the CUDA variant's hook)."""

    # ---- set-up, once per worker, after the model is loaded ---------------------------------------
    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)
        if self.mask is not None and self.slot is None:
            plan_worker(self.vllm_config, self.mask, self.dense_prompt)

    # ---- attention ------------------------------------------------------------------------------
    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.slot is None:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the LeanK backend")
        if attn_metadata is None:  # profiling run
            return output
        md = attn_metadata
        window_md = get_forward_context().attn_metadata[self.window_name]
        n = md.num_actual_tokens
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        q = query[:n].view(n, hq, d)
        k = key[:n].view(n, hkv, d)
        v = value[:n].view(n, hkv, d)
        out = output[:n].view(n, hq, d)
        # this layer's runs of the pages: [num_blocks, block_size, columns], read with the view's slot
        packed = self.slot.packed_view(kv_cache)
        window = self.slot.window_view(self.window_store.kv_cache)
        slot, scales = self.view_slot, (layer._k_scale_float, layer._v_scale_float, self.fp8)
        kernels.write(packed, md.slot_mapping, window, window_md.slot_mapping, k, v, slot, *scales)
        nd = md.num_decodes
        if nd:
            out[:nd] = kernels.decode(
                q[:nd], packed, md.block_table[:nd], window, window_md.block_table[:nd], md.seq_lens[:nd],
                self.plan, slot, self.scale, *scales,
            )  # fmt: skip
        for row, start, end, cached, prompt in md.extends:
            table = window_md.block_table[row]
            split = min(end, start + max(0, prompt - cached))  # queries before it are prompt queries: dense
            if split > start:
                kk, vv = request_kv(
                    self.plan, slot, packed, md.block_table[row], window, table, split - start + cached, cached,
                    k[start:split], v[start:split], q.dtype, *scales, whole=True,
                )  # fmt: skip
                out[start:split] = kernels.dense_prefill(q[start:split], kk, vv, cached, self.scale)
            if end > split:  # generated tokens recomputed after a preemption, or the positional rule
                first = cached + split - start
                kk, vv = request_kv(
                    self.plan, slot, packed, md.block_table[row], window, table,
                    first + end - split, first, k[split:end], v[split:end], q.dtype, *scales,
                )  # fmt: skip
                out[split:end] = kernels.prefill(self.plan, slot, q[split:end], kk, vv, first, self.scale)
        return output


def plan_worker(vllm_config: Any, mask: ChannelMask, dense_prompt: bool = False) -> WorkerPlan:
    """Lay out this worker's LeanK pages and wire its attention layers to them (once per worker).

    Finds every attention layer of the model, refuses one that is not LeanK's while a mask is set
    (it would serve dense attention silently), plans the pages, registers the stores and makes
    each LeanK layer share the packed store's cache.

    ``dense_prompt``: the metadata builder needs each request's prompt length. vLLM 0.32 passes it to attention
    builders (``CommonAttentionMetadata.rswa_prefix_lens``) for models with Reference Sliding Window Attention
    only, when the model config has an ``rswa_window``; the worker's copy of the config gets one here, after
    every attention backend is chosen (so no backend selection sees it). No other part of vLLM reads it for a
    model whose layers are plain attention layers, which every layer of a LeanK model is.
    """
    from vllm.distributed import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )
    from vllm.distributed.utils import get_pp_indices
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    context = vllm_config.compilation_config.static_forward_context
    layers: dict[int, tuple[str, Any]] = {}
    for name, module in context.items():
        if not isinstance(module, Attention) or module.attn_type != AttentionType.DECODER:
            continue
        impl = module.impl
        if not isinstance(impl, LeanKAttentionMixin) or impl.mask is None:
            raise MaskError(
                f"a LeanK mask is set but layer {name} runs {type(impl).__name__}: LeanK runs in vLLM's "
                "CPU_ATTN backend (CPU build) and TRITON_ATTN (CUDA), which vLLM picks by itself for a decoder "
                "layer while a mask is set (leave --attention-backend out)"
            )
        index = extract_layer_index(name)
        if (impl.num_kv_heads, impl.head_size) != (None, None) and impl.head_size != mask.head_dim:
            raise MaskError(f"LeanK mask head_dim {mask.head_dim} != layer {name}'s {impl.head_size}")
        layers[index] = (name, module)
    if not layers:
        raise MaskError("a LeanK mask is set but the model has no decoder attention layer")
    order = sorted(layers)
    cache = vllm_config.cache_config
    block = cache.block_size if getattr(cache, "user_specified_block_size", False) else DEFAULT_BLOCK_SIZE
    pp = get_pp_group().world_size
    stages = [list(range(*get_pp_indices(mask.num_layers, r, pp))) for r in range(pp)]
    plan = WorkerPlan.build(
        mask, order, get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank(), block, stages,
        dense_prompt,
    )
    if dense_prompt:
        arch = vllm_config.model_config.model_arch_config
        if arch.rswa_window is not None:
            raise MaskError("LeanK's dense-prompt rule cannot serve a model with R-SWA attention")
        arch.rswa_window = plan.window
    kernels.prepare(plan, vllm_config.device_config.device_type)  # before any CUDA graph capture
    first_name, first = layers[order[0]]
    if plan.num_kv_heads != first.impl.num_kv_heads:
        raise MaskError(
            f"LeanK plan has {plan.num_kv_heads} KV heads per rank, vLLM's layer has {first.impl.num_kv_heads}"
        )
    packed_spec, window_spec = kv_specs(plan, first.kv_cache_torch_dtype, get_kv_quant_mode(first.kv_cache_dtype))
    backend = PackedBackend
    packed_name = f"{first_name}.{PACKED_SUFFIX}"
    Store(packed_name, packed_spec, backend, vllm_config)
    windows = [
        Store(f"{layers[store[0]][0]}.{WINDOW_SUFFIX}", window_spec, WindowBackend, vllm_config)
        for store in plan.window_layers
    ]
    for index in order:
        module = layers[index][1]
        impl = module.impl
        impl.plan, impl.slot = plan, plan.slots[index]
        impl.view_slot = impl.slot.in_view()
        impl.window_store = windows[impl.slot.window_store]
        impl.window_name = impl.window_store.layer_name
        module.kv_sharing_target_layer_name = packed_name
        module.attn_backend = backend
    return plan


class LeanKCPUAttentionImpl(LeanKAttentionMixin, CPUAttentionBackendImpl):
    """vLLM's CPU attention, or LeanK attention when the engine names a mask (see the module docstring)."""


class LeanKCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU backend with the LeanK implementation (same name, ``CPU_ATTN``, as it replaces it)."""

    @staticmethod
    def get_impl_cls() -> type[LeanKCPUAttentionImpl]:
        return LeanKCPUAttentionImpl
