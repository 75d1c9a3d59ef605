"""The KV cache spec of LeanK's full-channel tokens in vLLM's pool: the sink and a sliding window.

A LeanK layer needs every channel of K and V for two sets of keys only: the first ``sink`` tokens
of a request, and the window of recent tokens before each query (see :mod:`leank_infer.decode.rule`).
Every token's kept channels live in the packed pages (:mod:`leank_infer.vllm.pool`); these blocks hold
the rest of those tokens' channels (rest rows). vLLM's sliding-window
spec almost describes this window, but drops the sink; :class:`LeanKWindowSpec` is a sliding
window that keeps its first ``sink_len`` tokens, managed by :class:`LeanKWindowManager`, a
:class:`~vllm.v1.core.single_type_kv_cache_manager.SlidingWindowManager` that

- never frees the sink blocks (it frees the gap between the sink and the window, as vLLM's
  reference-sliding-window manager frees the gap after a prompt),
- allocates real blocks only for tokens some later query reads with every channel (the sink and
  the last ``sliding_window`` tokens of what is computed at the end of the step; a long prefill
  chunk reads its own tokens from the step's K/V), and null blocks for the rest,
- counts a prefix-cache hit only where the sink blocks and the window before the hit are cached,
- keeps real blocks for the window before a shared-prefix junction: when a request shares a prefix
  with cached packed pages that the window pages do not cover (vLLM's ``shared_prefix_boundary``, as
  for its sliding-window and Mamba groups), the window ending there is written and cached, so the
  requests after it hit the prefix cache at the junction.

Under the ``"dense-prompt"`` rule, the default (the pool sets ``dense_prompt=True`` for it; the field's own
default, False, is the ``"positional"`` rule's), a prompt query attends to every earlier
prompt token with every channel, so while a request's prompt is being computed the manager keeps a real
block for every prompt token (chunked prefill reads the earlier chunks' full rows), and frees the gap once
the prompt is done. Only blocks made wholly of prompt tokens are cached, and a hit needs every block from
the first (full attention's rule): a cached prefix is then exactly what the request's own prompt computes.

It is registered with vLLM's :class:`~vllm.v1.kv_cache_spec_registry.KVCacheSpecRegistry`, the
interface vLLM 0.32 gives out-of-tree code for new spec types (:func:`register`). vLLM allocates,
counts, frees, caches and preempts these blocks like any other. :func:`kv_specs` gives vLLM the specs of a worker's
plan (:class:`~leank_infer.vllm.pool.WorkerPlan`): the packed store's and the window stores', one page size, each
with its own block size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from ..mask import MaskError
from .pool import WorkerPlan, steady_blocks


@dataclass(frozen=True, kw_only=True)
class LeanKWindowSpec(SlidingWindowSpec):
    """Full-channel K/V of a request's first ``sink_len`` tokens and of its last ``sliding_window`` ones."""

    sink_len: int = 0
    dense_prompt: bool = False  # every prompt token's full row is kept while the prompt is computed
    # what the start-up check of the pool needs (:meth:`LeanKWindowManager.check_pool`; 0: no check): how many
    # window stores share the pool with the one packed store, and the max_model_len the worker planned for
    window_stores: int = 0
    max_model_len: int = 0
    packed_block_size: int = 0  # tokens per block of the packed store (0: this spec's block_size)

    @property
    def packed_block(self) -> int:
        """Tokens per block of the packed store (this spec's own ``block_size`` unless ``packed_block_size``)."""
        return self.packed_block_size or self.block_size

    @property
    def sink_blocks(self) -> int:
        return cdiv(self.sink_len, self.block_size)

    def steady_blocks(self, max_model_len: int) -> int:
        """Blocks a request holds at most once its prompt is computed: the sink, the window it keeps, and the
        window the step fills.

        A step that computes ``n`` tokens after ``c`` keeps the blocks of ``[c - window + 1, c)``
        (read by its first queries) and allocates those of ``[c + n - window + 1, c + n)`` (read by
        the next step); the gap between them is never allocated (:class:`LeanKWindowManager`).
        """
        # no more than the request has
        return steady_blocks(min(self.sink_len, max_model_len), min(self.sliding_window, max_model_len), self.block_size)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """The most blocks a request of up to ``max_model_len`` tokens holds at once (vLLM admits a request only
        when its need, capped at this, is free): :meth:`steady_blocks` while decoding, and under ``dense_prompt``
        every block of its prompt while that is computed (the window is inside the prompt then, and the gap is
        freed before the first decode step allocates), whichever is more."""
        del max_in_flight_tokens
        prompt = cdiv(max_model_len, self.block_size) if self.dense_prompt else 0
        return max(prompt, self.steady_blocks(max_model_len))

    def request_blocks(self, max_model_len: int) -> tuple[int, int]:
        """(packed, window) blocks one request of ``max_model_len`` tokens holds at once, per store, while its
        prompt is computed: what vLLM's admission asks the pool for (a window store keeps every prompt block
        under ``dense_prompt``, else the sink and the window)."""
        packed = cdiv(max_model_len, self.packed_block)
        prompt = cdiv(max_model_len, self.block_size)
        if self.dense_prompt:
            return packed, prompt
        return packed, min(prompt, self.steady_blocks(max_model_len))

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """What vLLM's "KV cache size" report counts per request: the blocks it keeps while decoding (as for
        vLLM's sliding windows, whose long prefill chunks also read more for a while)."""
        return self.steady_blocks(vllm_config.model_config.max_model_len) * self.page_size_bytes

    def is_uniform_with_collection(self, kv_cache_specs: dict) -> bool:
        return all(
            isinstance(s, LeanKWindowSpec)
            and (s.sliding_window, s.sink_len, s.dense_prompt) == (self.sliding_window, self.sink_len, self.dense_prompt)
            for s in kv_cache_specs.values()
        )


class LeanKWindowManager(SlidingWindowManager):
    """vLLM's sliding-window manager, keeping the sink blocks and allocating only blocks that are read later."""

    def __init__(self, kv_cache_spec: LeanKWindowSpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.check_pool()
        self.sink_blocks = kv_cache_spec.sink_blocks
        self.dense_prompt = kv_cache_spec.dense_prompt
        self._step_blocks: dict[str, list[Any]] = {}  # per request, the list the last allocation returned
        self._prompt: dict[str, int] = {}  # per request, its prompt length (dense_prompt: blocks kept until done)

    def check_pool(self) -> None:
        """Refuse, at engine start, a pool too small for one request of max_model_len (one MaskError naming the
        numbers): vLLM would admit no such request, ever, and hold it waiting without a word.

        vLLM's own start-up check counts what :meth:`LeanKWindowSpec.max_memory_usage_bytes` reports, the blocks a
        request keeps while it decodes; admission asks for more under ``dense_prompt``, every prompt block in
        every window store at once (:meth:`LeanKWindowSpec.request_blocks`). Blocks of other groups of the pool
        (a hybrid model's own sliding-window layers) come on top, so the need named is a lower bound."""
        spec = self.kv_cache_spec
        if not spec.window_stores or not spec.max_model_len:
            return
        packed, window = spec.request_blocks(spec.max_model_len)
        need = packed + spec.window_stores * window
        usable = self.block_pool.num_gpu_blocks - 1  # vLLM holds one back (its null block)
        if need > usable:
            rule = "the dense-prompt rule" if spec.dense_prompt else "the positional rule"
            raise MaskError(
                f"LeanK: the KV pool's {usable} blocks cannot hold one request of "
                f"max_model_len {spec.max_model_len} under {rule}: it needs at least {need} at once ({packed} packed "
                f"blocks of {spec.packed_block} tokens + {spec.window_stores} window stores x "
                f"{window} blocks of {spec.block_size}), so vLLM would never admit a request that long; "
                "give the KV cache more memory (or a larger num_gpu_blocks_override), or lower max_model_len"
                + (", or serve with leank_rule 'positional'" if spec.dense_prompt else "")
            )

    # ---- which blocks hold data ----------------------------------------------------------------
    def _real(self, index: int, num_tokens: int, prompt: int = 0) -> bool:
        """Whether block ``index`` needs storage once ``num_tokens`` tokens are computed (``prompt``: the
        request's prompt length under ``dense_prompt``, whose blocks hold data until it is computed)."""
        first_kept = max(0, num_tokens - self.sliding_window + 1) // self.block_size
        in_prompt = self.dense_prompt and index * self.block_size < prompt
        return index < self.sink_blocks or index >= first_kept or in_prompt

    def _num_real_new(self, have: int, num_tokens: int, prompt: int = 0) -> int:
        need = cdiv(num_tokens, self.block_size)
        return sum(self._real(i, num_tokens, prompt) for i in range(have, need))

    def _skipped(self, computed: int, prompt: int) -> int:
        """Tokens before the window that no query reads with every channel any more (none while a dense prompt
        is still being computed)."""
        if self.dense_prompt and computed < prompt:
            return 0
        return self.get_num_skipped_tokens(computed)

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free the blocks between the sink and the window (the sink stays); vLLM calls this before each
        allocation, with the prompt length, which is remembered for it."""
        if num_prompt_tokens is not None:
            self._prompt[request_id] = num_prompt_tokens
        prompt = self._prompt.get(request_id, 0)
        skipped = self._skipped(processed_computed_tokens, prompt) // self.block_size
        self._remove_blocks_in_range(request_id, self.sink_blocks, skipped)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Any],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        del num_local_computed_tokens, num_tokens_main_model
        prompt = self._prompt.get(request_id, prefill_end)  # the admission check comes before the first removal
        if request_id in self.num_cached_block:  # a running request
            assert len(new_computed_blocks) == 0
            count = self._num_real_new(len(self.req_to_blocks.get(request_id, ())), num_tokens, prompt)
        else:
            have = max(len(new_computed_blocks), self._skipped(total_computed_tokens, prompt) // self.block_size)
            count = self._num_real_new(have, num_tokens, prompt)
            # cached blocks the request touches leave the free queue: count them as taken
            count += self._get_num_evictable_blocks(
                [b for i, b in enumerate(new_computed_blocks) if self._real(i, total_computed_tokens, prompt)]
            )
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            count = min(count, self.max_admission_blocks_per_request)
        return count

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[Any]:
        """Real blocks for the sink and the window that later queries read; null blocks in between."""
        del num_tokens_main_model
        blocks = self.req_to_blocks[request_id]
        need = cdiv(num_tokens, self.block_size)
        if need <= len(blocks):
            return []
        prompt = self._prompt.get(request_id, 0)
        real = [self._real(i, num_tokens, prompt) for i in range(len(blocks), need)]
        fresh = iter(self.block_pool.get_new_blocks(sum(real)))
        new = [next(fresh) if r else self._null_block for r in real]
        blocks.extend(new)
        if self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in new if not b.is_null)
        self._step_blocks[request_id] = new
        return new  # the worker appends these to its block table: nulls keep the positions aligned

    def cache_blocks(self, request: Any, num_tokens: int, retention_interval: int | None = None, **kwargs: Any) -> None:
        if self.dense_prompt:  # blocks of prompt tokens only: a later request's prompt computes nothing else
            self._step_blocks.pop(request.request_id, None)
            num_tokens = min(num_tokens, request.num_prompt_tokens)
        else:
            self._keep_junction_window(request, num_tokens)
        super().cache_blocks(request, num_tokens, retention_interval, **kwargs)

    def _keep_junction_window(self, request: Any, num_tokens: int) -> None:
        """Real blocks, in place of this step's null ones, for the window before the request's shared-prefix
        junction (vLLM calls ``cache_blocks`` right after the allocation, before the worker sees the blocks).

        Only whole blocks this step allocated and computes, and only while the pool has them free: the
        junction is an optimisation, never a reason to fail or to evict."""
        junction = getattr(request, "shared_prefix_boundary", 0) // self.block_size * self.block_size
        new = self._step_blocks.pop(request.request_id, None)
        blocks = self.req_to_blocks.get(request.request_id)
        if not junction or not new or blocks is None or junction > num_tokens:
            return
        offset = len(blocks) - len(new)  # blocks[offset:] are this step's
        first = max(self.sink_blocks, offset, max(0, junction - self.sliding_window + 1) // self.block_size)
        tail = [i for i in range(first, junction // self.block_size) if blocks[i].is_null]
        if not tail or self.block_pool.get_num_free_blocks() < len(tail):
            return
        for i, block in zip(tail, self.block_pool.get_new_blocks(len(tail)), strict=True):
            blocks[i] = new[i - offset] = block
            if self._record_new_block_ids:
                self.new_block_ids.append(block.block_id)

    def pop_blocks_for_free(self, request_id: str) -> list[Any]:
        self._step_blocks.pop(request_id, None)
        self._prompt.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Any],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """A prefix-cache hit: keep its sink blocks and its window, nulls in between (under ``dense_prompt``,
        every block of a hit inside the prompt)."""
        blocks = self.req_to_blocks[request_id]
        assert len(blocks) == 0
        total = num_local_computed_tokens + num_external_computed_tokens
        skipped = self._skipped(total, self._prompt.get(request_id, 0)) // self.block_size
        kept = [
            b if (i < self.sink_blocks or i >= skipped) else self._null_block for i, b in enumerate(new_computed_blocks)
        ]
        kept += [self._null_block] * max(0, skipped - len(kept))
        if self.enable_caching:
            self.block_pool.touch([b for b in kept if not b.is_null])
        blocks.extend(kept)
        self.num_cached_block[request_id] = len(blocks)

    # ---- prefix-cache hits ---------------------------------------------------------------------
    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Any,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: Any,
        kv_cache_spec: Any,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list[Any], ...], int]:
        """The sliding-window hit, valid only where the sink blocks are cached too (else the longest hit
        made of cached blocks from the start, which holds the sink by itself)."""
        from vllm.v1.core.kv_cache_utils import resolve_block_hashes

        assert isinstance(kv_cache_spec, LeanKWindowSpec)
        if kv_cache_spec.dense_prompt:  # full attention's hit: the cached blocks from the first on
            from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

            full = FullAttentionSpec(block_size=kv_cache_spec.block_size, num_kv_heads=kv_cache_spec.num_kv_heads,
                                     head_size=kv_cache_spec.head_size, dtype=kv_cache_spec.dtype)  # fmt: skip
            return FullAttentionManager.find_longest_cache_hit(
                block_hashes, max_length, kv_cache_group_ids, block_pool, full,
                drop_eagle_block, alignment_tokens, dcp_world_size, pcp_world_size,
            )  # fmt: skip
        computed, hit = super().find_longest_cache_hit(
            block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
            drop_eagle_block, alignment_tokens, dcp_world_size, pcp_world_size,
        )  # fmt: skip
        bs = kv_cache_spec.block_size
        hashes = resolve_block_hashes(
            block_hashes,
            block_pool.hash_block_size,
            bs,
            supports_fine_grained_hash_lookup=cls.supports_fine_grained_hash_lookup,
            alignment_tokens=alignment_tokens,
        )
        n = len(computed[0])
        for i in range(min(kv_cache_spec.sink_blocks, n)):
            if not computed[0][i].is_null:
                continue
            cached = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if cached is None:  # the sink is gone: only a hit inside the blocks cached from the start
                keep = i
                while keep and (keep * bs) % alignment_tokens:
                    keep -= 1
                for c in computed:
                    del c[keep:]
                return computed, keep * bs
            for c, block in zip(computed, cached, strict=True):
                c[i] = block
        return computed, hit

    @classmethod
    def reachable_block_mask(cls, *args: Any, **kwargs: Any) -> list[bool] | None:
        """vLLM's sparse retention of window blocks, and every sink block (under ``dense_prompt``: every block)."""
        spec = kwargs.get("kv_cache_spec", args[3] if len(args) > 3 else None)
        if spec.dense_prompt:
            return None
        mask = super().reachable_block_mask(*args, **kwargs)
        if mask is None:
            return None
        start = kwargs.get("start_block", args[0] if args else 0)
        for i in range(start, min(start + len(mask), spec.sink_blocks)):
            mask[i - start] = True
        return mask


def kv_specs(
    plan: WorkerPlan,
    dtype: torch.dtype,
    quant_mode: Any = None,
    page_bytes: int | None = None,
    max_model_len: int = 0,
) -> tuple[Any, Any]:
    """vLLM specs of the packed store and of (every) window store (blocks of ``plan.block_size`` and
    ``plan.window_block`` tokens): one page size, ``plan.page_elements``
    (or ``page_bytes``, at least that, where the model's sliding-window layers share the pool). ``max_model_len``:
    the engine's, for the window stores' start-up check of the pool (0: none)."""
    item = torch.empty((), dtype=dtype).element_size()
    page = plan.page_elements * item
    if page_bytes is not None:
        if page_bytes < page:
            raise ValueError(f"page_bytes {page_bytes} is smaller than the plan's page ({page} bytes)")
        page = page_bytes
    common = dict(
        block_size=plan.block_size, num_kv_heads=plan.num_kv_heads, head_size=plan.head_dim, dtype=dtype,
        num_head_slots=1, page_size_padded=page,
    )  # fmt: skip
    if quant_mode is not None:
        common["kv_quant_mode"] = quant_mode
    packed = FullAttentionSpec(state_content_bytes=plan.packed_row * item, **common)
    window = LeanKWindowSpec(
        state_content_bytes=plan.window_row * item, sliding_window=plan.window, sink_len=plan.sink,
        dense_prompt=plan.dense_prompt, window_stores=len(plan.window_layers) if max_model_len else 0,
        max_model_len=max_model_len, packed_block_size=plan.block_size, **{**common, "block_size": plan.window_block},
    )  # fmt: skip
    return packed, window


_registered = False


def register() -> None:
    """Register the spec and its manager with vLLM (built-in specs first, so vLLM's own are not skipped)."""
    global _registered
    if _registered:
        return
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()  # registration of vLLM's own specs runs once, on an empty registry
    KVCacheSpecRegistry.register(LeanKWindowSpec, LeanKWindowManager, uniform_type_base_spec=LeanKWindowSpec)
    _registered = True
