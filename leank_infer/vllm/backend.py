"""LeanK attention for vLLM: every K/V byte in vLLM's pool, the positional rule, batched decode.

Registered by :func:`leank_infer.vllm.register` in place of ``CPU_ATTN`` (vLLM's CPU build) and
``TRITON_ATTN`` (CUDA, which vLLM's selection then gives every decoder layer, no flag needed:
:mod:`~leank_infer.vllm.backend_cuda`): without a LeanK mask in the engine's settings every layer is vLLM's
own attention, unchanged. With one, each full-attention decoder layer of the model is a LeanK layer (a
sliding-window layer, which the transformers path leaves whole too, stays vLLM's own attention with vLLM's
KV cache spec, its pages sized to LeanK's: :func:`plan_worker`):

- its K/V live in the worker's LeanK pages (:mod:`~leank_infer.vllm.pool`): packed rows for every
  token, and for the sink and the window the channels a packed row lacks (rest rows). The layer shares the packed store's cache and block
  table (vLLM's cross-layer KV sharing) and reads its window store's metadata from the forward
  context. vLLM sizes, counts ("KV cache size: N tokens"), frees, caches and preempts all of it;
- a prompt query attends to the prompt with every channel, and every generated query follows the positional
  rule (:func:`~leank_infer.decode.rule.positional_recent_from`): the ``"dense-prompt"`` rule, the default
  (``leank_rule: "positional"`` makes prompt queries follow the positional rule too). The outcome depends on
  positions and the prompt's length only, so chunked prefill, prefix-cache hits and preemption give the
  tokens an unchunked, uncached, uninterrupted run gives (up to floating point), and so does
  ``LeanKModel(..., rule=...)`` with the same rule;
- the decode requests of a step (one new token each; vLLM puts them first) go to one kernel call per
  layer (:mod:`~leank_infer.vllm.kernels`); the prompt queries of a step's chunks attend densely over their
  prompts' full rows: on vLLM's CPU build all of them in one call of vLLM's own CPU attention over a scratch copy
  (:mod:`~leank_infer.vllm.cpu_prefill`), on CUDA one SDPA call per request
  (:func:`~leank_infer.vllm.kernels.dense_prefill`); queries that follow the positional rule gather their
  request's K/V and run the positional prefill (:func:`~leank_infer.vllm.kernels.prefill`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from ..mask import ChannelMask, MaskError, dense_layers_of
from . import cpu_prefill, kernels
from .kv_specs import kv_specs
from .paged_reference import request_kv
from .pool import DEFAULT_BLOCK_SIZE, PACKED_SUFFIX, WINDOW_SUFFIX, LayerSlot, WorkerPlan
from .settings import check_engine, load_checked_mask, settings_from
from .stores import PackedBackend, Store, WindowBackend

_NO_WINDOW = (-1, None, (-1, -1))  # how vLLM's CPU and Triton implementations spell "no sliding window"
_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


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
        self.prefix_align: int | None = None  # leank_prefix_align (None: vLLM's block size)
        self._bound: kernels.BoundLayer | None = None
        self._bound_key: tuple | None = None
        config = get_current_vllm_config()
        self.vllm_config = config
        self.windowed = False  # a sliding-window layer of a LeanK model: vLLM's own attention and KV spec
        settings = settings_from(getattr(config, "additional_config", None))
        if settings is None or self.attn_type != AttentionType.DECODER:
            return  # vLLM's own attention
        self.mask = load_checked_mask(settings, config.model_config.hf_config, config.model_config.model)
        self.dense_prompt = settings.dense_prompt
        self.prefix_align = settings.prefix_align
        if self.sliding_window not in _NO_WINDOW:
            self.windowed = True  # left whole, as the transformers path leaves it (plan_worker checks the index)
            return
        check_engine(config)
        self.check_platform(config)
        refused = [  # what the LeanK kernels do not apply: serving on without it would give other tokens
            what
            for what, used in (
                (f"attention logit soft-capping (cap {getattr(self, 'logits_soft_cap', None)})",
                 bool(getattr(self, "logits_soft_cap", None))),  # vLLM spells "none" 0 (CPU) or None
                ("ALiBi position biases", getattr(self, "alibi_slopes", None) is not None),
                ("attention sinks (a learned logit per head, as gpt-oss has)", getattr(self, "sinks", None) is not None),
            )
            if used
        ]  # fmt: skip
        if refused:
            raise MaskError(f"LeanK serving does not support {' or '.join(refused)} on full-attention layers")
        self.fp8 = _FP8.get(config.cache_config.cache_dtype)

    def check_platform(self, vllm_config: Any) -> None:
        """Refuse what this implementation cannot run (the CUDA variant's hook)."""

    # ---- set-up, once per worker, after the model is loaded ---------------------------------------
    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)
        if self.mask is not None and self.plan is None:
            plan_worker(self.vllm_config, self.mask, self.dense_prompt, self.prefix_align)

    # ---- attention ------------------------------------------------------------------------------
    def _bind(self, layer: Any, kv_cache: torch.Tensor, dtype: torch.dtype) -> kernels.BoundLayer:
        """This layer's write and decode over its views of the pages (bound at its first step; again only if
        vLLM hands it other pages, the dtype changes or the fp8 scales are computed)."""
        window_cache = self.window_store.kv_cache
        key = (kv_cache.data_ptr(), window_cache.data_ptr(), dtype, layer._k_scale_float, layer._v_scale_float)
        if self._bound_key != key:
            self._bound = kernels.BoundLayer(
                self.plan, self.view_slot, self.slot.packed_view(kv_cache), self.slot.window_view(window_cache),
                dtype, self.scale, layer._k_scale_float, layer._v_scale_float, self.fp8,
            )  # fmt: skip
            self._bound_key = key
        return self._bound

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
        bound = self._bind(layer, kv_cache, q.dtype)
        bound.write(md.slot_mapping, window_md.slot_mapping, k, v)
        nd = md.num_decodes
        if md.multi is not None:  # the decodes and a few generated queries of other requests, one row each
            tokens, rows, keys, runs = md.multi
            out[tokens] = bound.decode(q[tokens], md.block_table[rows], window_md.block_table[rows], keys, runs=runs)
        elif nd:
            bound.decode(q[:nd], md.block_table, window_md.block_table, md.seq_lens, out[:nd])
        packed, window, slot, scales = bound.packed, bound.window, bound.slot, bound.scales
        if md.prompts is not None:  # vLLM's CPU build: every prompt query of the step in one call of vLLM's kernel
            cpu_prefill.attend(md.prompts, bound, q, k, v, out, md.block_table, window_md.block_table)
        for row, start, split, end, cached in md.extends:
            table = window_md.block_table[row]
            if split > start and md.prompts is None:  # prompt queries, dense: one SDPA call per request
                kk, vv = kernels.prompt_kv(
                    self.plan, slot, packed, md.block_table[row], window, table, split - start + cached, cached,
                    k[start:split], v[start:split], q.dtype, *scales,
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


def plan_worker(
    vllm_config: Any, mask: ChannelMask, dense_prompt: bool = False, prefix_align: int | None = None
) -> WorkerPlan:
    """Lay out this worker's LeanK pages and wire its attention layers to them (once per worker).

    Finds every attention layer of the model, refuses one that is not LeanK's while a mask is set
    (it would serve dense attention silently), plans the pages, registers the stores and makes
    each LeanK layer share the packed store's cache.

    ``dense_prompt``: the metadata builder needs each request's prompt length. vLLM 0.32 passes it to attention
    builders (``CommonAttentionMetadata.rswa_prefix_lens``) for models with Reference Sliding Window Attention
    only, when the model config has an ``rswa_window``; the worker's copy of the config gets one here, after
    every attention backend is chosen (so no backend selection sees it). No other part of vLLM reads it for a
    model whose layers are plain attention layers, which every LeanK layer is; vLLM's CPU attention, which runs
    the sliding-window layers of a hybrid model, ignores it (its GPU backends would not: refused there).

    ``prefix_align``: the ``leank_prefix_align`` setting, the most tokens vLLM may align prefix-cache hits to where
    LeanK's pages take block sizes that fill them (:func:`~leank_infer.vllm.pool.fit_blocks`); by default the block
    size vLLM would use without LeanK (``cache_config.block_size``), so LeanK's hits are never coarser than plain
    vLLM's. Unless ``--block-size`` names the packed block, the plugin picks it too.
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
    attention = {
        name: module
        for name, module in context.items()
        if isinstance(module, Attention) and module.attn_type == AttentionType.DECODER
    }
    for name, module in attention.items():
        impl = module.impl
        if not isinstance(impl, LeanKAttentionMixin) or impl.mask is None:
            raise MaskError(
                f"a LeanK mask is set but layer {name} runs {type(impl).__name__}: LeanK runs in vLLM's "
                "CPU_ATTN backend (CPU build) and TRITON_ATTN (CUDA), which vLLM picks by itself for a decoder "
                "layer while a mask is set (leave --attention-backend out)"
            )
    windowed_layers = set(dense_layers_of(vllm_config.model_config.hf_config))  # the transformers path's rule
    layers: dict[int, tuple[str, Any]] = {}
    windowed: list[Any] = []
    for name, module in attention.items():
        impl = module.impl
        index = extract_layer_index(name)
        if impl.windowed != (index in windowed_layers):  # both paths must leave the same layers whole
            raise MaskError(
                f"layer {name}: vLLM gives it {'a' if impl.windowed else 'no'} sliding window "
                f"({impl.sliding_window}) but the model config says it is "
                f"{'a sliding-window' if index in windowed_layers else 'a full-attention'} layer; LeanK prunes "
                "full-attention layers only and cannot tell which this one is"
            )
        if impl.windowed:
            impl.attention_layer = module  # its spec gets the block size that fills LeanK's page (_share_pages)
            windowed.append(impl)
            continue
        if (impl.num_kv_heads, impl.head_size) != (None, None) and impl.head_size != mask.head_dim:
            raise MaskError(f"LeanK mask head_dim {mask.head_dim} != layer {name}'s {impl.head_size}")
        layers[index] = (name, module)
    if not layers:
        raise MaskError(
            "a LeanK mask is set but the model has no full-attention decoder layer (sliding-window layers "
            "are left whole): LeanK has nothing to prune"
        )
    if windowed and dense_prompt and vllm_config.device_config.device_type != "cpu":
        # the dense-prompt rule passes prompt lengths through vLLM's R-SWA field (below), which vLLM's GPU
        # backends would then apply to the sliding-window layers as well
        raise MaskError(
            "LeanK serves models with sliding-window layers on GPUs under leank_rule 'positional' only"
        )
    order = sorted(layers)
    cache = vllm_config.cache_config
    user_block = getattr(cache, "user_specified_block_size", False)
    block = cache.block_size if user_block else DEFAULT_BLOCK_SIZE
    # hits no coarser than plain vLLM's own: its block size (the CPU platform's default is 128 tokens, CUDA's 16)
    prefix_align = prefix_align or cache.block_size
    pp = get_pp_group().world_size
    stages = [
        [i for i in range(*get_pp_indices(mask.num_layers, r, pp)) if i not in windowed_layers] for r in range(pp)
    ]
    plan = WorkerPlan.build(  # a hybrid model's page is cut to its windowed layers' kernel: window blocks as packed ones
        mask, order, get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank(), block, stages,
        dense_prompt, fit_window=not windowed, prefix_align=prefix_align, fit_packed=not user_block,
    )
    first_name, first = layers[order[0]]
    page_bytes = None
    if windowed:
        plan, page_bytes = _share_pages(plan, windowed, first, vllm_config, user_block)
    if dense_prompt:
        arch = vllm_config.model_config.model_arch_config
        if arch.rswa_window is not None:
            raise MaskError("LeanK's dense-prompt rule cannot serve a model with R-SWA attention")
        arch.rswa_window = plan.window
    kernels.prepare(plan, vllm_config.device_config.device_type)  # before any CUDA graph capture
    if plan.num_kv_heads != first.impl.num_kv_heads:
        raise MaskError(
            f"LeanK plan has {plan.num_kv_heads} KV heads per rank, vLLM's layer has {first.impl.num_kv_heads}"
        )
    packed_spec, window_spec = kv_specs(
        plan, first.kv_cache_torch_dtype, get_kv_quant_mode(first.kv_cache_dtype), page_bytes,
        vllm_config.model_config.max_model_len,
    )  # fmt: skip
    backend = PackedBackend
    packed_name = f"{first_name}.{PACKED_SUFFIX}"
    Store(packed_name, packed_spec, backend, vllm_config)
    windows = [
        Store(f"{layers[store[0]][0]}.{WINDOW_SUFFIX}", window_spec, WindowBackend, vllm_config)
        for store in plan.window_layers
    ]
    for impl in windowed:
        impl.plan = plan  # planned: the worker's windowed layers keep vLLM's own attention and KV spec
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


def _share_pages(
    plan: WorkerPlan, windowed: list[Any], first: Any, vllm_config: Any, user_block: bool
) -> tuple[WorkerPlan, int]:
    """One page size for LeanK's stores and the model's sliding-window layers (vLLM's pool has one).

    vLLM gives a sliding-window layer its own spec (``SlidingWindowSpec``) and, where page sizes differ, pads the
    smaller pages to the largest. Instead the pages are made equal: LeanK's page (``block`` tokens of its widest
    row) is rounded up to whole multiples of what the windowed layers' attention kernel reads (its smallest
    block of their full rows), LeanK's block (16, 32, ... up to 128 tokens unless ``--block-size`` names it) is
    the first whose rounding wastes at most 1/8 of the page (else the least wasteful), and each windowed layer's
    spec is vLLM's own with the block size that fills that page exactly. Returns the plan and the page in bytes.
    """
    from dataclasses import replace

    from vllm.v1.attention.backend import MultipleOf

    item = torch.empty((), dtype=first.kv_cache_torch_dtype).element_size()
    row = max(plan.packed_row, plan.window_row) * item  # bytes per token of LeanK's widest store
    specs = [impl_layer_spec(impl, vllm_config) for impl in windowed]
    per_token = {replace(s, block_size=1, page_size_padded=None).page_size_bytes for s in specs}
    if len(per_token) != 1:
        raise MaskError(f"LeanK needs the model's sliding-window layers to have one K/V size per token: {per_token}")
    sw_token = per_token.pop()
    sizes = windowed[0].attention_layer.get_attn_backend().get_supported_kernel_block_sizes()
    kernel = min(s.base if isinstance(s, MultipleOf) else s for s in sizes)  # the windowed kernel's block unit
    unit = kernel * sw_token
    blocks = [plan.block_size] if user_block else list(range(16, 129, 16))

    def page(b: int) -> int:
        return -(-b * row // unit) * unit

    best = next((b for b in blocks if (page(b) - b * row) * 8 <= page(b)), None)
    best = best or min(blocks, key=lambda b: (page(b) - b * row) / page(b))
    plan = replace(plan, block_size=best, window_block=best)
    size = page(best)
    for impl, spec in zip(windowed, specs, strict=True):
        fixed = replace(spec, block_size=size // sw_token, page_size_padded=None)
        impl.attention_layer.get_kv_cache_spec = lambda _config, fixed=fixed: fixed  # vLLM's spec, the block filling a page
    return plan, size


def impl_layer_spec(impl: Any, vllm_config: Any) -> Any:
    """The KV cache spec vLLM's attention layer of ``impl`` declares (a ``SlidingWindowSpec`` for a windowed one)."""
    return type(impl.attention_layer).get_kv_cache_spec(impl.attention_layer, vllm_config)


class LeanKCPUAttentionImpl(LeanKAttentionMixin, CPUAttentionBackendImpl):
    """vLLM's CPU attention, or LeanK attention when the engine names a mask (see the module docstring)."""


class LeanKCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU backend with the LeanK implementation (same name, ``CPU_ATTN``, as it replaces it)."""

    @staticmethod
    def get_impl_cls() -> type[LeanKCPUAttentionImpl]:
        return LeanKCPUAttentionImpl
