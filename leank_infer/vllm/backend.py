"""LeanK attention for vLLM: pruned pages, exact LeanK decode (:class:`LeanKAttentionMixin`).

Registered by :func:`leank_infer.vllm.register` in place of ``CPU_ATTN`` (vLLM's
``register_backend`` override of a built-in backend; the CUDA variant over ``TRITON_ATTN`` is
:mod:`~leank_infer.vllm.backend_cuda`). Without a LeanK mask in the engine's settings every layer
is vLLM's own attention, unchanged. With one, each full-attention layer:

- gets a KV cache spec whose page holds, per token, only the kept K channels and the V of heads
  keeping any (:mod:`~leank_infer.vllm.layout`); vLLM sizes its pool with it, so its
  "KV cache size: N tokens" report grows by ``1 / bytes ratio``;
- prefill: attends with every channel (SDPA over the prompt's own K/V), then stores the packed
  rows in the pages and the full K/V of the sink and recent tokens in a small per-request side
  store (at most ``sink + recent + accumu + 1`` tokens per request and layer, outside vLLM's pool);
- decode: the LeanK rule (:func:`leank_infer.decode.rule.recent_from`, the core's rule): sink and recent keys
  with every channel from the side store, middle keys with the kept channels read from the packed
  pages through the block table, every decode request of a step in one call per layer (fp32 on
  CPU: the fused kernel :mod:`~leank_infer.vllm.cpu_kernel`; else :mod:`~leank_infer.vllm.paged_decode`;
  on CUDA tensors the Triton kernel :mod:`~leank_infer.vllm.triton_paged`, per request).

Refused with a clear error at start-up: prefix caching, chunked prefill (a prompt must be
prefilled in one step, as the HF path does), tensor parallelism, quantised KV cache. A request
that vLLM preempts is recomputed as one longer prefill, after which its recent window starts
where the HF path's would after that longer prompt (documented, not hidden).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.kv_cache_interface import FullAttentionSpec

from ..decode.rule import recent_from
from ..mask import ChannelMask, MaskError
from . import cpu_kernel
from .layout import PackedLayout
from .paged_decode import paged_decode_batch
from .settings import load_checked_mask, settings_from
from .triton_paged import triton_paged_decode


def check_engine(vllm_config: Any) -> None:
    """Refuse engine settings the LeanK backend does not implement (one error naming the flag)."""
    problems = []
    if vllm_config.cache_config.enable_prefix_caching:
        problems.append("prefix caching (pass --no-enable-prefix-caching / LLM(enable_prefix_caching=False))")
    if vllm_config.scheduler_config.enable_chunked_prefill:
        problems.append(
            "chunked prefill (pass --no-enable-chunked-prefill / LLM(enable_chunked_prefill=False); "
            "then max_num_batched_tokens must be at least max_model_len)"
        )
    if vllm_config.parallel_config.tensor_parallel_size != 1:
        problems.append(
            f"tensor parallelism (tensor_parallel_size={vllm_config.parallel_config.tensor_parallel_size})"
        )
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        problems.append(f"a quantised KV cache (kv_cache_dtype={vllm_config.cache_config.cache_dtype!r})")
    if problems:
        raise MaskError("LeanK serving does not support " + "; ".join(problems))


_NO_WINDOW = (-1, None, (-1, -1))  # how vLLM's CPU and Triton implementations spell "no sliding window"


@dataclass
class _RequestState:
    """Full-channel K/V of one request in one layer: the sink, and the recent part from ``tail_start``."""

    prefill_len: int
    length: int
    head_k: torch.Tensor  # [min(sink, length), Hkv, D]
    head_v: torch.Tensor
    tail_start: int
    tail_k: torch.Tensor  # [length - tail_start, Hkv, D]
    tail_v: torch.Tensor
    seen: int = 0  # the forward step that last touched it

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.head_k, self.head_v, self.tail_k, self.tail_v))


class LeanKAttentionMixin:
    """LeanK attention over a vLLM attention implementation (the next class in the MRO), which runs
    every layer that is not LeanK's: no mask in the engine, a dense layer of the mask, a sliding window."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mask: ChannelMask | None = None
        self.layout: PackedLayout | None = None
        self.layer_index: int | None = None
        self.states: OrderedDict[int, _RequestState] = OrderedDict()
        self.step = 0
        self.kernel_tensors: tuple[torch.Tensor, ...] | None = (
            None  # the fused CPU kernel's view of the layout
        )
        config = get_current_vllm_config()
        settings = settings_from(getattr(config, "additional_config", None))
        if (
            settings is None
            or self.attn_type != AttentionType.DECODER
            or self.sliding_window not in _NO_WINDOW
        ):
            return  # not a LeanK layer: vLLM's own attention
        check_engine(config)
        self.check_platform(config)
        self.mask = load_checked_mask(settings, config.model_config.hf_config, config.model_config.model)
        self.max_states = 2 * config.scheduler_config.max_num_seqs + 8

    def check_platform(self, vllm_config: Any) -> None:
        """Refuse what this implementation cannot run (the CUDA variant needs eager mode)."""

    def _on(self, device: torch.device) -> PackedLayout:
        """The layer's layout with its indices on ``device`` (moved once)."""
        if self.layout.k_index.device != device:
            self.layout = self.layout.to(device)
        return self.layout

    # ---- binding to a layer of the mask -------------------------------------------------------
    def bind(self, layer_name: str) -> None:
        """Take this layer's row of the mask (once); a dense layer of the mask falls back to vLLM's attention."""
        if self.mask is None or self.layer_index is not None:
            return
        self.layer_index = extract_layer_index(layer_name)
        if self.layer_index in self.mask.dense_layers:
            self.mask = None
            return
        keep = self.mask.keep[self.layer_index]
        if tuple(keep.shape) != (self.num_kv_heads, self.head_size):
            raise MaskError(
                f"LeanK mask row of layer {self.layer_index} is {tuple(keep.shape)} (kv_heads, head_dim), "
                f"the vLLM layer {layer_name} has {(self.num_kv_heads, self.head_size)}"
            )
        self.layout = PackedLayout.from_keep(keep)

    def leank_kv_cache_spec(self, layer_name: str, spec: FullAttentionSpec) -> FullAttentionSpec:
        """The layer's spec with one packed row per token (``num_head_slots=1``, ``state_content_bytes=width``)."""
        self.bind(layer_name)
        if self.layout is None or type(spec) is not FullAttentionSpec:
            return spec
        return replace(spec, num_head_slots=1, state_content_bytes=self.layout.bytes_per_token(spec.dtype))

    # ---- cache writes ------------------------------------------------------------------------
    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self.bind(layer.layer_name)
        if self.layout is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()
        rows = (
            self._on(key.device)
            .pack(key[:n].view(n, self.num_kv_heads, -1), value[:n].view(n, self.num_kv_heads, -1))
            .to(kv_cache.dtype)
        )
        pages = self._pages(kv_cache)
        if n and int(slots.min()) < 0:  # padding tokens carry slot -1 (a boolean select costs ~0.5 ms on CPU)
            keep = slots >= 0
            slots, rows = slots[keep], rows[keep]
        pages.index_copy_(0, slots, rows)

    def _pages(self, kv_cache: torch.Tensor) -> torch.Tensor:
        # [num_blocks, 1, block_size, width] -> one row per slot (a view: writes land in vLLM's pool)
        return kv_cache.view(-1, kv_cache.shape[-1])

    # ---- attention ---------------------------------------------------------------------------
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
        self.bind(layer.layer_name)
        if self.layout is None:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the LeanK backend")
        if attn_metadata is None:  # warm-up
            return output
        n = attn_metadata.num_actual_tokens
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        q = query[:n].view(n, hq, d)
        k = key[:n].view(n, hkv, d)
        v = value[:n].view(n, hkv, d)
        out = output[:n].view(n, hq, d)
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        pages = self._pages(kv_cache)
        block_size = kv_cache.shape[2]
        self.step += 1
        decodes: list[
            tuple[int, int, int, int]
        ] = []  # (request index, token index, request id, cached tokens)
        for i in range(len(seq_lens)):
            s, e = starts[i], starts[i + 1]
            if e <= s:
                continue
            q_len, total = e - s, seq_lens[i]
            context = total - q_len
            rid = int(attn_metadata.block_table[i, 0])
            if context == 0:
                out[s:e] = self._prefill(rid, q[s:e], k[s:e], v[s:e])
                self.states[rid].seen = self.step
            elif q_len == 1:
                decodes.append((i, s, rid, context))
            else:
                raise RuntimeError(
                    f"LeanK got {q_len} new tokens after {context} cached ones (chunked prefill, prefix caching "
                    "or speculative decoding): not supported, the engine should have refused them at start-up"
                )
        if decodes:
            self._decode(
                decodes, q, k, v, out, pages.view(-1, block_size, pages.shape[-1]), attn_metadata.block_table
            )
        self._forget_finished()
        return output

    def _forget_finished(self) -> None:
        """Drop the side store of requests absent from two steps in a row: they finished or were preempted.

        vLLM schedules every running request at every step in the settings this backend accepts (no
        chunked prefill: a decode needs one token of the budget); a preempted request comes back as a
        new prefill, which rebuilds its state. A request that is skipped anyway fails loudly at its next
        decode (``_decode``), never silently.
        """
        stale = [rid for rid, st in self.states.items() if st.seen < self.step - 1]
        for rid in stale:
            del self.states[rid]

    def _prefill(self, rid: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Every channel, causal (as the HF path's prefill); then the sink and recent part go to the side store."""
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=self.scale,
            enable_gqa=True,
        )
        t = q.shape[0]
        mask = self.mask
        head = min(mask.sink_size, t)
        tail_start = max(head, recent_from(t, t, mask.recent_size, mask.accumu_size))
        self.states[rid] = _RequestState(
            t,
            t,
            k[:head].clone(),
            v[:head].clone(),
            tail_start,
            k[tail_start:].clone(),
            v[tail_start:].clone(),
        )
        self.states.move_to_end(rid)
        while len(self.states) > self.max_states:
            self.states.popitem(last=False)
        return o[0].transpose(0, 1)

    def _advance(
        self, rid: int, length: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Add one token at position ``length`` to a request's side store; its full-channel K/V
        ``[nf, Hkv, D]`` and where its middle ends (the rule's ``recent_from`` over ``length`` cached keys)."""
        st = self.states.get(rid)
        if st is None or st.length != length:
            raise RuntimeError(
                f"LeanK lost the full-channel state of a request (block {rid}, {length} cached tokens): "
                "more requests alive than max_num_seqs allows for, or a preemption the backend did not see"
            )
        self.states.move_to_end(rid)
        st.seen = self.step
        mask = self.mask
        r = recent_from(st.prefill_len, length, mask.recent_size, mask.accumu_size)
        start = max(st.head_k.shape[0], r)
        if start > st.tail_start:  # these tokens became middle tokens: their packed rows are in the pages
            drop = start - st.tail_start
            st.tail_k, st.tail_v, st.tail_start = st.tail_k[drop:], st.tail_v[drop:], start
        if length < mask.sink_size:
            st.head_k, st.head_v = torch.cat([st.head_k, k[None]]), torch.cat([st.head_v, v[None]])
        else:
            st.tail_k, st.tail_v = torch.cat([st.tail_k, k[None]]), torch.cat([st.tail_v, v[None]])
        st.length = length + 1
        return torch.cat([st.head_k, st.tail_k]), torch.cat([st.head_v, st.tail_v]), r

    def _decode(
        self,
        decodes: list[tuple[int, int, int, int]],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        pages: torch.Tensor,
        block_table: torch.Tensor,
    ) -> None:
        """Every decode request of the step (one new token each) with the LeanK rule, written into ``out``.

        On CPU one batched call per layer: the fused C kernel for fp32 (:mod:`~leank_infer.vllm.cpu_kernel`),
        else :func:`~leank_infer.vllm.paged_decode.paged_decode_batch`; on CUDA the Triton kernel per request.
        """
        parts = [self._advance(rid, length, k[t], v[t]) for _, t, rid, length in decodes]
        layout = self._on(q.device)
        sink = self.mask.sink_size
        if q.is_cuda:
            for (i, t, _, _), (full_k, full_v, r) in zip(decodes, parts, strict=True):
                out[t] = triton_paged_decode(
                    q[t], full_k, full_v, pages, block_table[i], sink, r, layout, self.scale
                )
            return
        reqs = [i for i, _, _, _ in decodes]
        toks = [t for _, t, _, _ in decodes]
        b = len(decodes)
        # a pure decode step (the common case) takes views: requests 0..B-1, tokens t0..t0+B-1
        rows = block_table[:b] if reqs == list(range(b)) else block_table[torch.tensor(reqs, device=q.device)]
        tok = slice(toks[0], toks[0] + b) if toks == list(range(toks[0], toks[0] + b)) else torch.tensor(toks)
        full_k = pad_sequence([p[0] for p in parts], batch_first=True)
        full_v = pad_sequence([p[1] for p in parts], batch_first=True)
        full_len = torch.tensor([p[0].shape[0] for p in parts], device=q.device)
        args = (
            q[tok],
            full_k,
            full_v,
            full_len,
            pages,
            rows,
            sink,
            [p[2] for p in parts],
            layout,
            self.scale,
        )
        if q.dtype == torch.float32 and cpu_kernel.available():  # one fused pass over the packed rows
            if self.kernel_tensors is None:
                self.kernel_tensors = cpu_kernel.kernel_tensors(layout)
            out[tok] = cpu_kernel.cpu_paged_decode_batch(*args, tensors=self.kernel_tensors)
        else:
            out[tok] = paged_decode_batch(*args)

    def states_nbytes(self) -> int:
        """Bytes of the side store of this layer right now (full-channel sink and recent K/V)."""
        return sum(s.nbytes() for s in self.states.values())


class LeanKCPUAttentionImpl(LeanKAttentionMixin, CPUAttentionBackendImpl):
    """vLLM's CPU attention, or LeanK attention when the engine names a mask (see the module docstring)."""


class LeanKCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU backend with the LeanK implementation (same name, ``CPU_ATTN``, as it replaces it)."""

    @staticmethod
    def get_impl_cls() -> type[LeanKCPUAttentionImpl]:
        return LeanKCPUAttentionImpl
