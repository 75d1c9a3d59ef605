"""The KV cache layers that own LeanK's pages in vLLM (:mod:`leank_infer.vllm.pool`), and their metadata.

A store is an attention-like layer with a KV cache spec and no forward, registered in vLLM's static
forward context as vLLM's own per-request ring buffers are (``models/deepseek_v41/compressor.py``):
vLLM then allocates its pages in the shared pool, gives it a block table per request, and frees,
caches and preempts its blocks. The packed store's group also holds the model's LeanK attention
layers (cross-layer KV sharing): they get its cache and its metadata (:class:`LeanKMetadata`).
Each window store has a group of its own, whose metadata is just its block table and slot mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from .cpu_decode import runs_of
from .cpu_prefill import PromptBatch, plan_prompts
from .pool import WorkerPlan


@dataclass
class WindowMetadata:
    """A window store's view of a step: where each request's full-channel tokens are."""

    block_table: torch.Tensor  # [num_reqs, blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64: page slot of each scheduled token (null block: slot < block_size)


@dataclass
class LeanKMetadata:
    """One step of the packed group, read by every LeanK layer (decodes come first: ``reorder_batch_threshold=1``)."""

    num_actual_tokens: int
    num_decodes: int  # requests with one new token; they are rows [0, num_decodes) and tokens [0, num_decodes)
    seq_lens: torch.Tensor  # [num_reqs] int32: tokens of each request after this step
    block_table: torch.Tensor  # [num_reqs, blocks] int32 (packed store)
    slot_mapping: torch.Tensor  # [num_tokens] int64 (packed store)
    # the other requests (prefill chunks, or several tokens), and under the "dense-prompt" rule the decodes whose
    # one token is a prompt token; one tuple each: (row, first token, split, end token, cached): the queries before
    # ``split`` are prompt queries under the "dense-prompt" rule (they attend densely), the rest follow the positional
    # rule (all of them under the positional rule); ``cached`` tokens of the request precede the first
    extends: tuple[tuple[int, int, int, int, int], ...]
    # requests with a few generated queries (speculative decoding's drafts, a short run of generated tokens
    # recomputed): the batched decode runs them too, one row per query, each over its request's pages up to its
    # own position (the rule depends on the position only). ``None`` when the step has none; else the rows'
    # (token index, request row, keys, runs) for every decode row, the one-token decodes first; ``runs`` (host int32)
    # marks each request's rows as one run, so the CPU kernel reads the middle they share once
    multi: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # on vLLM's CPU build, the extends' prompt queries laid out for vLLM's own CPU attention (one call per layer for
    # all of them: :mod:`~leank_infer.vllm.cpu_prefill`); ``None`` elsewhere or when the step has none
    prompts: PromptBatch | None = None


class WindowBuilder(AttentionMetadataBuilder[WindowMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> WindowMetadata:
        cm = common_attn_metadata
        return WindowMetadata(cm.block_table_tensor, cm.slot_mapping[: cm.num_actual_tokens])


class LeanKBuilder(AttentionMetadataBuilder[LeanKMetadata]):
    """The packed group's metadata: tensors for the batched decode, a short list of the prefill chunks."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: int | None = 1

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device):
        from .settings import settings_from

        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        settings = settings_from(getattr(vllm_config, "additional_config", None))
        self.dense_prompt = settings is not None and settings.dense_prompt
        self.max_multi = max_multi_queries(vllm_config)
        # (LeanK's page block, query heads, KV heads, head size, dtype) of vLLM's CPU attention over the step's prompt
        # queries
        self.cpu_prompts: tuple[int, int, int, int, torch.dtype] | None = None
        plan = worker_plan(vllm_config)
        context = vllm_config.compilation_config.static_forward_context
        heads = {context[name].impl.num_heads for name in layer_names if hasattr(context.get(name), "impl")}
        if self.dense_prompt and torch.device(device).type == "cpu" and plan is not None and len(heads) == 1:
            self.cpu_prompts = (
                plan.block_size, heads.pop(), plan.num_kv_heads, plan.head_dim, vllm_config.model_config.dtype
            )

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> LeanKMetadata:
        cm = common_attn_metadata
        num_decodes, num_prefills, _, _ = split_decodes_and_prefills(cm, decode_threshold=1)
        lens_cpu = cm.seq_lens_cpu_upper_bound if cm.seq_lens_cpu_upper_bound is not None else cm.seq_lens.cpu()
        prompts = None
        if self.dense_prompt:
            if cm.rswa_prefix_lens is None:  # set up by backend.plan_worker; a silent positional prefill else
                raise RuntimeError("LeanK's dense-prompt rule needs the prompt lengths vLLM did not pass")
            prompts = cm.rswa_prefix_lens[: cm.num_reqs]
        # a one-token step is a decode for vLLM, but the last prompt token (a prefix-cache hit that leaves one
        # token, a one-token chunk) is a prompt query under the dense-prompt rule: it runs as an extend too,
        # after the batched decode, whose output for it is overwritten
        prompt_rows = []
        if prompts is not None and num_decodes:
            prompt_rows = torch.nonzero(lens_cpu[:num_decodes] <= prompts[:num_decodes].to(lens_cpu.device)).flatten().tolist()
        extends: tuple[tuple[int, int, int, int, int], ...] = ()
        multi = batch = None
        if num_prefills or prompt_rows:  # host values, once per step (not per layer): the chunks' bounds
            starts = cm.query_start_loc_cpu.tolist()
            lens = lens_cpu.tolist()
            sizes = prompts.tolist() if prompts is not None else [0] * cm.num_reqs
            rows = [*prompt_rows, *range(num_decodes, cm.num_reqs)]
            for i in rows:
                start, end = starts[i], starts[i + 1]
                cached = lens[i] - (end - start)
                if end > start:  # the queries before split are prompt queries (dense-prompt rule)
                    extends += ((i, start, min(end, start + max(0, sizes[i] - cached)), end, cached),)
            # a few generated queries of a request (every query at or past its prompt length): batched decode rows
            few = [e for e in extends if e[0] >= num_decodes and e[3] - e[1] <= self.max_multi and e[2] == e[1]]
            if few:
                extends = tuple(e for e in extends if e not in few)
                multi = _multi_rows(num_decodes, few, cm.seq_lens)
            chunks = [(row, start, split, cached) for row, start, split, _, cached in extends if split > start]
            if chunks and self.cpu_prompts is not None:
                batch = plan_prompts(chunks, cm.block_table_tensor, *self.cpu_prompts)
        return LeanKMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_decodes=num_decodes,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping[: cm.num_actual_tokens],
            extends=extends,
            multi=multi,
            prompts=batch,
        )


MAX_MULTI_QUERIES = 16  # a request with at most this many generated queries in a step runs in the batched decode


def max_multi_queries(vllm_config: Any) -> int:
    """How many generated queries of one request the batched decode takes in a step: at most
    :data:`MAX_MULTI_QUERIES`, and fewer than the window (``recent + accumu``), so that every key those queries
    score with every channel is in a real window block (the window manager leaves the start of a longer run of
    new tokens, with the step's lookahead slots, unallocated: such a run reads its own K/V from the step, in the
    extend path)."""
    plan = worker_plan(vllm_config)
    spec = getattr(vllm_config, "speculative_config", None)
    lookahead = (getattr(spec, "num_speculative_tokens", None) or 0) if spec is not None else 0
    # the window manager keeps the window of the step's last slot, lookahead slots included
    return 0 if plan is None else max(0, min(MAX_MULTI_QUERIES, plan.window - 1 - lookahead))


def worker_plan(vllm_config: Any) -> WorkerPlan | None:
    """The worker's LeanK plan (:func:`~leank_infer.vllm.backend.plan_worker`), ``None`` before it or without a mask."""
    context = vllm_config.compilation_config.static_forward_context
    plans = [getattr(getattr(m, "impl", None), "plan", None) for m in context.values()]
    return next((p for p in plans if p is not None), None)


def _multi_rows(
    num_decodes: int, few: list[tuple[int, int, int, int, int]], seq_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, request row, keys, runs) of every decode row: the one-token decodes, then one row per query of ``few``,
    each request's rows one run (:func:`~leank_infer.vllm.cpu_decode.runs_of`).

    A query ``back`` tokens before its request's last one sees ``seq_len - back`` keys, taken from the exact
    ``seq_lens`` on the device: the host's upper bound (vLLM's ``seq_lens_cpu_upper_bound``) assumes every draft of an
    asynchronously scheduled speculative step was accepted."""
    tokens, rows, back = list(range(num_decodes)), list(range(num_decodes)), [0] * num_decodes
    for row, start, _, end, _ in few:
        tokens += range(start, end)
        rows += [row] * (end - start)
        back += range(end - 1 - start, -1, -1)
    device = seq_lens.device
    rows_t = torch.tensor(rows, dtype=torch.long, device=device)
    keys = seq_lens.index_select(0, rows_t) - torch.tensor(back, dtype=seq_lens.dtype, device=device)
    runs = runs_of([1] * num_decodes + [end - start for _, start, _, end, _ in few])
    return torch.tensor(tokens, dtype=torch.long, device=device), rows_t, keys.to(torch.int32), runs


class StoreBackend(AttentionBackend):
    """Backend of a store, and of the LeanK layers once they share the packed store: metadata only
    (their attention is the implementation vLLM built them with)."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @staticmethod
    def get_impl_cls() -> Any:
        raise NotImplementedError("LeanK's stores have no attention of their own")

    @staticmethod
    def get_kv_cache_shape(*args: Any, **kwargs: Any) -> tuple[int, ...]:
        raise NotImplementedError("LeanK stores are laid out by their spec")

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []


class WindowBackend(StoreBackend):
    @staticmethod
    def get_name() -> str:
        return "LEANK_WINDOW"

    @staticmethod
    def get_builder_cls() -> type[WindowBuilder]:
        return WindowBuilder


class PackedBackend(StoreBackend):
    @staticmethod
    def get_name() -> str:
        return "LEANK"

    @staticmethod
    def get_builder_cls() -> type[LeanKBuilder]:
        return LeanKBuilder


class Store(torch.nn.Module, AttentionLayerBase):
    """A LeanK page store: registered in the static forward context under ``name``, with ``spec`` and ``backend``."""

    def __init__(self, name: str, spec: Any, backend: type[AttentionBackend], vllm_config: Any):
        super().__init__()
        self.layer_name = name
        self.spec = spec
        self.backend = backend
        self.kv_cache = torch.tensor([])
        context = vllm_config.compilation_config.static_forward_context
        if name in context:
            raise ValueError(f"duplicate layer name {name!r}")
        context[name] = self

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def get_kv_cache_spec(self, vllm_config: Any) -> Any:
        return self.spec

    def get_attn_backend(self) -> type[AttentionBackend]:
        return self.backend
