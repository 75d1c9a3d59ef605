"""The dense-prompt prefill on vLLM's CPU build: every prompt chunk of a step in one call of vLLM's own CPU attention.

A prompt query attends to its request's prompt with every channel (the ``"dense-prompt"`` rule): the model's own
causal attention, the computation plain vLLM runs. LeanK's pages hold those tokens split in two (packed row, rest
row), which vLLM's kernel cannot read, so a step copies them into a scratch of vLLM's own CPU pages, one run of
blocks per request: each request's earlier prompt tokens gathered from LeanK's pages
(:func:`~leank_infer.vllm.kernels.prompt_rows`), the chunk's own K/V from the step. Where vLLM lays a block out as
:func:`pages` reads it (its ``vec`` kernels) the library writes both straight into the scratch, over the threads
(:func:`~leank_infer.vllm.cpu_decode.gather`, :func:`~leank_infer.vllm.cpu_decode.put`); elsewhere (AMX, NEON) vLLM's
``cpu_attn_reshape_and_cache`` writes them (the interior of a block is then whatever vLLM's kernel reads). Then
``cpu_attention_with_kv_cache``, the kernel plain vLLM prefills with, runs once over every prompt chunk of the step,
with vLLM's scheduler metadata for it (:func:`plan_prompts`, once per step in the metadata builder).

The copy is the cost over plain vLLM: for a chunk after ``c`` cached prompt tokens, ``c`` rows gathered and written
per layer, once for all the requests that share them (a prefix-cache hit); the attention itself is plain vLLM's. The
scratch is allocated once per step (:func:`plan_prompts`) and its layers reuse it one after another.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from itertools import pairwise

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from . import cpu_decode, kernels

SCRATCH_BLOCK = 128  # tokens per block of the scratch pages at least (vLLM's CPU default)
SCRATCH_UNIT = 32  # a scratch block is a multiple of this (vLLM's CPU kernel takes multiples of 32)


@dataclass(frozen=True)
class PromptBatch:
    """A step's prompt queries, laid out for vLLM's CPU attention: the same for every layer of the step."""

    tokens: slice | torch.Tensor  # where the queries are among the step's tokens (a slice when they are one run)
    # the runs of earlier prompt tokens to gather: (request row, first token, tokens, first row in the gather buffer)
    gathers: tuple[tuple[int, int, int, int], ...]
    gather_blocks: tuple[torch.Tensor, ...]  # int32: each run's scratch blocks (a run starts at a block)
    earlier: int  # the gather buffer's rows
    earlier_slots: torch.Tensor  # [earlier] int64: their scratch slots
    query_slots: torch.Tensor  # [queries] int64: the scratch slots of the chunks' own tokens
    pad_slots: torch.Tensor  # int64: the rest of each request's last block (zeros in the scratch: vLLM's kernel reads
    # whole tiles)
    query_start_loc: torch.Tensor  # [requests + 1] int32
    seq_lens: torch.Tensor  # [requests] int32: earlier tokens + the chunk's
    block_table: torch.Tensor  # [requests, blocks] int32, into the scratch
    isa: str
    scheduler: torch.Tensor  # vLLM's scheduler metadata for these requests
    direct: bool  # vLLM's pages hold a block as :func:`pages` reads them: the library gathers straight into them
    # [num_blocks, Hkv, 2 * block_size, D]: the step's scratch pages, shared by its layers one after another (a fresh
    # one per layer faults its pages in again each time: 2.3x the gather's time on two threads); the pad slots zero
    scratch: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.scratch.shape[0]

    @property
    def block_size(self) -> int:
        """Tokens per block of the scratch: whole pages of LeanK's."""
        return self.scratch.shape[2] // 2


def pages(scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of vLLM's CPU pages ``scratch`` ``[blocks, Hkv, 2 * block, D]`` as ``[blocks, Hkv, block, D]`` views,
    as its ``vec`` kernels lay a block out: K transposed (``[D, block]`` per head), then V rows (``[block, D]``)."""
    blocks, heads, twice, dim = scratch.shape
    bs, (s0, s1, _, _) = twice // 2, scratch.stride()
    return scratch.as_strided((blocks, heads, bs, dim), (s0, s1, 1, bs)), scratch[:, :, bs:]


@functools.cache
def vllm_layout_is_known(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """Whether vLLM's ``cpu_attn_reshape_and_cache`` lays a block out as :func:`pages` reads it, for this ISA, dtype and
    shape: asked of vLLM itself once per process (its ``vec`` and ``vec16`` kernels do; AMX and NEON pack K
    otherwise, and then a step copies through a buffer and vLLM's write)."""
    k = (torch.arange(block_size * 2 * head_dim) % 251).view(block_size, 2, head_dim).to(dtype)  # exact in 16 bits
    v = k.flip(0)
    scratch = torch.zeros(1, 2, 2 * block_size, head_dim, dtype=dtype)
    key_cache, value_cache = scratch.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        k, v, key_cache, value_cache, torch.arange(block_size), isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )
    kk, vv = pages(scratch)
    return torch.equal(kk[0].transpose(0, 1), k) and torch.equal(vv[0].transpose(0, 1), v)


def scratch_block(page_block: int) -> int:
    """Tokens per scratch block over LeanK's pages of ``page_block`` tokens: whole pages (a scratch block of earlier
    tokens is keyed by the pages it copies), a multiple of :data:`SCRATCH_UNIT`, at least :data:`SCRATCH_BLOCK`."""
    unit = math.lcm(SCRATCH_UNIT, page_block)
    return unit * -(-SCRATCH_BLOCK // unit)


def plan_prompts(
    chunks: list[tuple[int, int, int, int]],
    packed_table: torch.Tensor,
    page_block: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> PromptBatch:
    """The :class:`PromptBatch` of a step's prompt chunks ``(request row, first token, end token, cached)``: the
    queries ``[first, end)`` of the step at positions ``cached + i`` (their request's prompt goes on past them), over
    LeanK's pages of ``page_block`` tokens (``packed_table``: the step's packed block table, on the host).

    Requests that share a cached prefix (vLLM's prefix cache gives them the same pages) share its scratch blocks
    too: a scratch block of earlier tokens is keyed by the LeanK pages it copies, so a document that many requests
    hit is gathered once per layer, not once per request, and vLLM's kernel reads it as plain vLLM reads its cached
    blocks. (The packed pages identify the window pages too: vLLM hits a prefix in every KV cache group or none.)"""
    bs = scratch_block(page_block)
    per = bs // page_block
    isa = _get_attn_isa(dtype, bs, head_dim, "auto")
    shared: dict[tuple[int, ...], int] = {}
    gathers, earlier_slots, query_slots, pad_slots, tables, starts, lens = [], [], [], [], [], [0], []
    blocks = rows = 0
    for request, start, end, cached in chunks:
        n, pages = end - start, packed_table[request].tolist()
        length = cached + n
        table = []
        for j in range(-(-length // bs)):
            lo, hi = j * bs, min((j + 1) * bs, cached)
            if (j + 1) * bs <= cached:  # a whole block of earlier tokens: shared by every request with its pages
                key = tuple(pages[j * per : (j + 1) * per])
                if key in shared:
                    table.append(shared[key])
                    continue
                shared[key] = blocks
            table.append(blocks)
            blocks += 1
            if hi > lo:  # earlier tokens this request gathers itself (a run goes on from the last one)
                if gathers and gathers[-1][0] == request and gathers[-1][1] + gathers[-1][2] == lo:
                    gathers[-1] = (request, gathers[-1][1], gathers[-1][2] + hi - lo, gathers[-1][3])
                else:
                    gathers.append((request, lo, hi - lo, rows))
                rows += hi - lo
                earlier_slots.append(torch.arange(lo, hi) % bs + table[-1] * bs)
        table_t = torch.tensor(table)
        own = torch.arange(cached, length)
        query_slots.append(table_t[own // bs] * bs + own % bs)
        pad_slots.append(torch.arange(length, len(table) * bs) % bs + table[-1] * bs)
        tables.append(table_t)
        starts.append(starts[-1] + n)
        lens.append(length)
    width = max(t.numel() for t in tables)
    block_table = torch.zeros(len(chunks), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_table[i, : t.numel()] = t
    contiguous = all(a[2] == b[1] for a, b in pairwise(chunks))
    tokens = (
        slice(chunks[0][1], chunks[-1][2])
        if contiguous
        else torch.cat([torch.arange(start, end) for _, start, end, _ in chunks])
    )
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scheduler = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(chunks),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=None,
        kv_cache_dtype="auto",
    )
    earlier_slots = torch.cat([torch.zeros(0, dtype=torch.long), *earlier_slots])
    gather_blocks = tuple((earlier_slots[row : row + n : bs] // bs).int() for _, _, n, row in gathers)
    pad_slots = torch.cat(pad_slots)
    scratch = torch.empty(blocks, num_kv_heads, 2 * bs, head_dim, dtype=dtype)
    if pad_slots.numel():  # a masked key still weighs its V by 0 in vLLM's kernel: no NaN may be there (no layer
        zeros = torch.zeros(pad_slots.numel(), num_kv_heads, head_dim, dtype=dtype)  # writes these slots)
        key_cache, value_cache = scratch.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            zeros, zeros, key_cache, value_cache, pad_slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
        )
    return PromptBatch(
        tokens, tuple(gathers), gather_blocks, rows, earlier_slots, torch.cat(query_slots), pad_slots,
        query_start_loc, seq_lens, block_table, isa, scheduler,
        vllm_layout_is_known(isa, dtype, bs, head_dim), scratch,
    )  # fmt: skip


def attend(
    batch: PromptBatch,
    bound: kernels.BoundLayer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    packed_table: torch.Tensor,
    window_table: torch.Tensor,
) -> None:
    """The prompt queries of ``batch`` among the step's ``q`` ``[n, Hq, D]`` (their K/V ``k``/``v`` ``[n, Hkv, D]``)
    attended over their requests' prompts with every channel, into ``out`` ``[n, Hq, D]``."""
    heads, dim, scratch = k.shape[1], k.shape[2], batch.scratch
    key_cache, value_cache = scratch.chunk(2, dim=2)  # vLLM's CPU view of a block: K rows then V rows
    kp, vp = pages(scratch)  # the same blocks as K transposed and V rows (where vLLM's kernels lay them out so)

    def put(kk: torch.Tensor, vv: torch.Tensor, slots: torch.Tensor) -> None:
        ops.cpu_attn_reshape_and_cache(
            kk, vv, key_cache, value_cache, slots, batch.isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
        )

    direct = batch.direct and cpu_decode.supports_gather(bound.packed, bound.window, q.dtype) and cpu_decode.available()
    if batch.earlier and direct:  # one pass: the library writes vLLM's page layout itself
        for (request, first, n, _), blocks in zip(batch.gathers, batch.gather_blocks, strict=True):
            cpu_decode.gather(
                bound.packed, packed_table[request], bound.window, window_table[request], n, bound.slot, kp, vp, blocks,
                first,
            )  # fmt: skip
    elif batch.earlier:  # the library's (or PyTorch's) rows, then vLLM's write
        kk = torch.empty(batch.earlier, heads, dim, dtype=q.dtype)
        vv = torch.empty_like(kk)
        plan, slot, packed, window = bound.plan, bound.slot, bound.packed, bound.window
        for request, first, n, row in batch.gathers:
            kernels.prompt_rows(
                plan, slot, packed, packed_table[request], window, window_table[request], n,
                kk[row : row + n], vv[row : row + n], *bound.scales, first=first,
            )  # fmt: skip
        put(kk, vv, batch.earlier_slots)
    sliced = isinstance(batch.tokens, slice)
    pick = (lambda t: t[batch.tokens]) if sliced else (lambda t: t.index_select(0, batch.tokens))
    own_k, own_v = pick(k), pick(v)
    if batch.direct and cpu_decode.available() and cpu_decode.supports_put(own_k, own_v, kp, vp):
        cpu_decode.put(own_k, own_v, batch.query_slots, kp, vp)  # vLLM's write, split over the threads
    else:
        put(own_k, own_v, batch.query_slots)
    queries = pick(q)
    result = out[batch.tokens] if sliced else torch.empty_like(queries)
    ops.cpu_attention_with_kv_cache(
        query=queries,
        key_cache=key_cache,
        value_cache=value_cache,
        output=result,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        scale=bound.scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=batch.block_table,
        softcap=0,
        scheduler_metadata=batch.scheduler,
        s_aux=None,
        dynamic_causal=None,
    )
    if not sliced:
        out.index_copy_(0, batch.tokens, result)
