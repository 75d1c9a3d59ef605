"""Random LeanK pages as vLLM lays them out (:mod:`leank_infer.vllm.pool`), for kernel tests (no vLLM needed).

:func:`random_pages` builds one worker's plan for a random mask, the packed and window pages of one
layer with block tables for a batch of requests, and writes each request's K/V where the engine
would: a packed row for every position, a rest row for the sink and the window of its next query.
Every other slot (other layers' columns, unused blocks, the gap between sink and window) holds NaN,
so a kernel that reads what the rule does not allow returns NaN instead of passing by luck.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from leank_infer.decode.rule import positional_recent_from
from leank_infer.mask import ChannelMask
from leank_infer.vllm.pool import LayerSlot, WorkerPlan

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass
class Pages:
    plan: WorkerPlan
    slot: LayerSlot
    q: torch.Tensor  # [B, Hq, D]
    packed: torch.Tensor  # [num_blocks, block_size, packed_row] (a view; block stride may exceed the page)
    packed_table: torch.Tensor  # [B, blocks] int32
    window: torch.Tensor  # [num_blocks, window_block, window_row]
    window_table: torch.Tensor  # [B, window blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per request [length, Hkv, D] in the compute dtype (what was written)
    values: list[torch.Tensor]
    k_scale: float = 1.0
    v_scale: float = 1.0
    fp8: torch.dtype | None = None


def random_mask(layers: int, heads: int, head_dim: int, counts: list[int], seed: int = 0, **sizes: int) -> ChannelMask:
    """A mask whose layer-0 heads keep ``counts`` channels (random channels; 0 = a head that keeps nothing)."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.zeros(layers, heads, head_dim, dtype=torch.bool)
    for layer in range(layers):
        for h in range(heads):
            c = counts[h % len(counts)] if layer == 0 else counts[(h + layer) % len(counts)]
            keep[layer, h, torch.randperm(head_dim, generator=g)[:c]] = True
    defaults = dict(sink_size=16, recent_size=64, accumu_size=16)
    defaults.update(sizes)
    return ChannelMask(keep, **defaults)


def random_pages(
    mask: ChannelMask,
    lengths: list[int],
    layer: int = 0,
    q_heads: int | None = None,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    fp8: str | None = None,
    seed: int = 0,
    extra_block_stride: int = 7,
    device: str = "cpu",
    whole_window: bool = False,
    window_block: int | None = None,
    lookback: int = 0,
) -> Pages:
    """Pages holding ``len(lengths)`` requests whose next query is at position ``length - 1`` (already written).

    ``whole_window``: every token's rest row in the window pages (a prompt being computed under the
    dense-prompt rule), not only the sink's and the last window's. ``window_block``: tokens per window page (default:
    the plan's, which :func:`~leank_infer.vllm.pool.fit_blocks` chose; ``block_size``: one block size). ``lookback``: rest
    rows also for the window of the query that many positions before the last (a run of speculative queries)."""
    g = torch.Generator().manual_seed(seed)
    plan = WorkerPlan.build(mask, list(range(mask.num_layers)), block_size=block_size)
    if window_block is not None:
        plan = replace(plan, window_block=window_block)
    wbs = plan.window_block
    slot = plan.slots[layer]
    h, d = plan.num_kv_heads, plan.head_dim
    hq = q_heads or h
    store = torch.float32 if fp8 is None else torch.uint8
    per_req = [-(-n // block_size) for n in lengths]
    per_win = [-(-n // wbs) for n in lengths]
    num_blocks = sum(per_req) + sum(per_win) + 3
    # one pool tensor per store, blocks strided by more than a page (other stores' pages sit between)
    packed_pool = torch.full((num_blocks, block_size * plan.packed_row + extra_block_stride), float("nan"))
    window_pool = torch.full((num_blocks, wbs * plan.window_row + extra_block_stride), float("nan"))
    if fp8 is not None:
        packed_pool = torch.full(packed_pool.shape, 0x7F, dtype=torch.uint8)  # 0x7F is NaN in e4m3 and e5m2
        window_pool = torch.full(window_pool.shape, 0x7F, dtype=torch.uint8)
    elif dtype != torch.float32:
        packed_pool, window_pool = packed_pool.to(dtype), window_pool.to(dtype)
    packed = packed_pool[:, : block_size * plan.packed_row].view(num_blocks, block_size, plan.packed_row)
    window = window_pool[:, : wbs * plan.window_row].view(num_blocks, wbs, plan.window_row)
    free = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 is vLLM's null block
    packed_table = torch.zeros(len(lengths), max(per_req), dtype=torch.int32)
    window_table = torch.zeros(len(lengths), max(per_win), dtype=torch.int32)
    k_scale, v_scale = (0.5, 2.0) if fp8 is not None else (1.0, 1.0)
    keys, values, used = [], [], 0
    layout = slot.layout
    for b, n in enumerate(lengths):
        k = torch.randn(n, h, d, generator=g)
        v = torch.randn(n, h, d, generator=g)
        if fp8 is not None:  # what the pages can hold exactly: values on the fp8 grid, times the scale
            k = k.to(FP8[fp8]).float() * k_scale
            v = v.to(FP8[fp8]).float() * v_scale
        else:
            k, v = k.to(dtype), v.to(dtype)
        keys.append(k)
        values.append(v)
        pblocks = free[used : used + per_req[b]]
        used += per_req[b]
        packed_table[b, : per_req[b]] = pblocks.int()
        rf = positional_recent_from(max(0, n - 1 - lookback), mask.recent_size, mask.accumu_size)
        first_kept = max(0, n - 1 - lookback - (mask.recent_size + mask.accumu_size) + 1) // wbs
        for i in range(per_win[b]):
            if whole_window or i * wbs < mask.sink_size or i >= first_kept:
                window_table[b, i] = int(free[used])
                used += 1
        assert rf >= first_kept * wbs or rf <= mask.sink_size
        for p in range(n):
            row = layout.pack(k[p : p + 1].float(), v[p : p + 1].float())[0]
            blk, off = int(packed_table[b, p // block_size]), p % block_size
            cols = slice(slot.packed_offset, slot.packed_offset + row.numel())
            wblk, woff = int(window_table[b, p // wbs]), p % wbs
            rest = layout.pack_rest(k[p : p + 1].float(), v[p : p + 1].float())[0]
            if fp8 is not None:
                nk, nkr = layout.k_index.numel(), layout.kr_index.numel()
                row = torch.cat([row[:nk] / k_scale, row[nk:] / v_scale]).to(FP8[fp8]).view(torch.uint8)
                rest = torch.cat([rest[:nkr] / k_scale, rest[nkr:] / v_scale]).to(FP8[fp8]).view(torch.uint8)
            packed[blk, off, cols] = row.to(packed.dtype)
            if wblk:
                window[wblk, woff, slot.window_offset : slot.window_offset + rest.numel()] = rest.to(window.dtype)
    q = torch.randn(len(lengths), hq, d, generator=g).to(dtype)
    if store is torch.uint8:
        q = q.float()
    to = lambda t: t.to(device)  # noqa: E731
    return Pages(
        plan, slot, to(q), to(packed), to(packed_table), to(window), to(window_table),
        torch.tensor(lengths, dtype=torch.int32, device=device), keys, values, k_scale, v_scale,
        FP8[fp8] if fp8 is not None else None,
    )  # fmt: skip


def reference(pages: Pages, scale: float) -> torch.Tensor:
    """The PyTorch reference (:mod:`leank_infer.vllm.paged_reference`) of every request's query, ``[B, Hq, D]``."""
    from leank_infer.vllm.paged_reference import reference_attention, request_kv

    out = []
    for b, n in enumerate(pages.seq_lens.tolist()):
        p = n - 1
        k, v = request_kv(
            pages.plan, pages.slot, pages.packed, pages.packed_table[b], pages.window, pages.window_table[b],
            n, p, pages.keys[b][p:].to(pages.q.dtype), pages.values[b][p:].to(pages.q.dtype), pages.q.dtype,
            pages.k_scale, pages.v_scale, pages.fp8,
        )  # fmt: skip
        out.append(reference_attention(pages.plan, pages.slot, pages.q[b : b + 1], k, v, p, scale)[0])
    return torch.stack(out)
