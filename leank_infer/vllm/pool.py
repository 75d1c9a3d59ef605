"""Where a vLLM worker keeps LeanK's K/V: two kinds of pages, both in vLLM's own KV pool.

- **Packed pages** (one store per worker, a full-attention KV cache group): for every LeanK layer of
  the worker, per token, the kept K channels of each KV head (heads in order, channels ascending) and
  then the whole V of each head that keeps any channel (:class:`~leank_infer.vllm.layout.PackedLayout`).
  Every token has one; middle keys are read from it.
- **Window pages** (:class:`~leank_infer.vllm.kv_specs.LeanKWindowSpec`, a few stores): per token the
  *rest row* of a run of layers (what the packed row lacks of the full K and V: the dropped K channels and
  the V of heads keeping none, :meth:`~leank_infer.vllm.layout.PackedLayout.pack_rest`), kept only for the
  sink and the recent window (the keys a later query scores with every channel), and under the
  ``"dense-prompt"`` rule for the whole prompt while it is being computed (its queries score every prompt
  token with every channel). A full row is the packed row plus the rest row: no element is stored twice.

Inside a page (one block of ``block_size`` tokens) each layer's data is one contiguous run, layer after
layer (``[layer][token][column]``): a layer's decode streams its run of each block, instead of a slice of
every token's row, which measured 1.4-2x faster on CPU (``benchmarks/vllm_kernel.py``, "layer-major").

One store's page must be the same size as every other's (vLLM's hybrid allocator shares one pool
of blocks between groups: :func:`vllm.v1.core.kv_cache_utils.unify_kv_cache_spec_page_size`), and a
layer's page size depends on its mask row. So the layers do not get a page each: the packed store
holds all of them side by side in one row (one group, any mix of kept counts, no padding but the
tensor-parallel one below), and the window stores hold as many layers' rest rows as fit in a packed
page (layers in order, a new store where the next one does not fit), padded to it. A window page holds a
block size of its own (:func:`fit_blocks`, which may pick the packed one too), so that its rows may be wider or
narrower than a packed row and the pages still be full. The model's attention layers share the packed store's
cache and block table through vLLM's cross-layer KV sharing (``kv_sharing_target_layer_name``); each layer reads
its own columns. Under tensor parallelism every rank keeps its KV heads' slice of the mask and lays its layers
out in its own row; the row is as wide as the widest rank's (all ranks must have the same pages), so
a rank whose heads keep fewer channels over the whole model pads the end of its row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..mask import ChannelMask, MaskError
from .layout import PackedLayout

PACKED_SUFFIX = "leank_packed"
WINDOW_SUFFIX = "leank_window"
DEFAULT_BLOCK_SIZE = 16  # tokens per packed page unless the user sets --block-size


def kv_heads_of_rank(total: int, tp_size: int, rank: int) -> list[int]:
    """The KV heads vLLM gives tensor-parallel rank ``rank`` (split when there are enough, else replicated)."""
    if total >= tp_size:
        if total % tp_size:
            raise MaskError(f"{total} KV heads cannot be split over tensor_parallel_size={tp_size}")
        per = total // tp_size
        return list(range(rank * per, (rank + 1) * per))
    if tp_size % total:
        raise MaskError(f"tensor_parallel_size={tp_size} is not a multiple of the model's {total} KV heads")
    return [rank // (tp_size // total)]


def packed_width(keep: torch.Tensor) -> int:
    """Elements of a packed row of one layer's ``[heads, head_dim]`` keep rows: kept K plus V of heads keeping any."""
    return int(keep.sum()) + int(keep.any(-1).sum()) * keep.shape[-1]


@dataclass(frozen=True)
class LayerSlot:
    """Where one LeanK layer's K/V live in this worker's pages (offsets in elements per token: a layer's run
    in a page starts at ``block_size * offset``)."""

    layer: int  # model layer index
    layout: PackedLayout  # this rank's kept channels
    packed_offset: int  # the packed columns of the layers before it
    packed_width: int  # its own packed columns
    window_store: int  # which window store holds the layer's rest rows
    window_offset: int  # the rest columns of the store's layers before it
    window_width: int = 0  # the layer's rest columns in its store (its rest row, padded to the widest rank's)

    def packed_view(self, cache: torch.Tensor) -> torch.Tensor:
        """The layer's packed rows ``[num_blocks, block_size, packed_width]`` in the packed store's cache
        ``[num_blocks, 1, block_size, packed_row]`` (a view: writes land in vLLM's pool)."""
        return _run(cache, self.packed_offset, self.packed_width)

    def window_view(self, cache: torch.Tensor) -> torch.Tensor:
        """The layer's rest rows ``[num_blocks, block_size, window_width]`` in its window store's cache (at least
        one column: a layer keeping every channel has no rest, and nothing reads its view)."""
        return _run(cache, self.window_offset, max(1, self.window_width))

    def in_view(self) -> LayerSlot:
        """This slot as the kernels see it, over :meth:`packed_view` and :meth:`window_view` (columns from 0)."""
        return replace(self, packed_offset=0, window_offset=0)


def _run(cache: torch.Tensor, offset: int, width: int) -> torch.Tensor:
    """``[num_blocks, block_size, width]`` rows starting ``block_size * offset`` elements into each page."""
    blocks, _, bs, _ = cache.shape
    return torch.as_strided(cache, (blocks, bs, width), (cache.stride(0), width, 1), cache.storage_offset() + bs * offset)


@dataclass(frozen=True)
class WorkerPlan:
    """This worker's LeanK pages: the packed row, the window stores, each layer's slot."""

    slots: dict[int, LayerSlot]
    packed_row: int  # elements of a packed-store row
    window_row: int  # elements of the widest window-store row (its real content; the page is padded)
    window_layers: tuple[tuple[int, ...], ...]  # the layers of each window store
    num_kv_heads: int  # this rank's
    head_dim: int
    block_size: int
    sink: int
    recent: int
    accumu: int
    dense_prompt: bool = False  # the "dense-prompt" rule: prompt queries read every prompt token's full row
    window_block: int = 0  # tokens per window page (its own block size; 0: block_size)

    def __post_init__(self) -> None:
        if not self.window_block:
            object.__setattr__(self, "window_block", self.block_size)

    @classmethod
    def build(
        cls,
        mask: ChannelMask,
        layers: list[int],
        tp_size: int = 1,
        tp_rank: int = 0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        stages: list[list[int]] | None = None,
        dense_prompt: bool = False,
        fit_window: bool = True,
        prefix_align: int | None = None,
        fit_packed: bool = False,
    ) -> WorkerPlan:
        """The plan for a worker running ``layers`` of the model on tensor-parallel rank ``tp_rank``.

        ``stages``: the layers of every pipeline stage (default: this worker's only). Every worker of
        the engine must have the same page size, so the packed row is the widest any (stage, rank)
        needs, and the window stores are cut from it the same way everywhere.

        ``fit_window``: give the window stores a block size of their own (:func:`fit_blocks`, prefix-cache hits
        aligned to at most ``prefix_align`` tokens, default ``block_size``) so that their pages, as large as a packed
        page, are filled; else they hold ``block_size`` tokens as the packed pages do. ``fit_packed``: pick the packed
        block too (a multiple of :data:`PACKED_BLOCK_STEP` from 16 to ``prefix_align``) instead of ``block_size``.
        """
        total_heads, head_dim = mask.num_kv_heads, mask.head_dim
        ranks = [kv_heads_of_rank(total_heads, tp_size, r) for r in range(tp_size)]
        mine = ranks[tp_rank]
        slots: dict[int, LayerSlot] = {}
        offset = 0
        full = 2 * len(mine) * head_dim
        for layer in layers:
            width = max(1, packed_width(mask.keep[layer][mine]))  # a layer keeping nothing still has a column
            slots[layer] = LayerSlot(layer, PackedLayout.from_keep(mask.keep[layer][mine]), offset, width, 0, 0)
            offset += width
        # every rank lays its own layers out; the row is the widest (stage, rank)'s: the pages must be equal
        offset = max(
            sum(max(1, packed_width(mask.keep[layer][r])) for layer in stage)
            for stage in (stages or [layers])
            for r in ranks
        )
        # rest rows, as wide as the widest rank's, so that every rank cuts the same stores; a store's row is a page
        # of every stage (one wider than a packed row widens every stage's page)
        def rest_of(layer: int) -> int:
            return full - min(packed_width(mask.keep[layer][r]) for r in ranks)

        rest = {layer: rest_of(layer) for layer in layers}
        all_rests = [[rest_of(layer) for layer in stage] for stage in (stages or [layers])]
        window = mask.recent_size + mask.accumu_size
        if fit_window:
            align = prefix_align or block_size
            blocks = [block_size]
            if fit_packed:
                blocks = list(range(DEFAULT_BLOCK_SIZE, align + 1, PACKED_BLOCK_STEP)) or [DEFAULT_BLOCK_SIZE]
            block_size, window_block, capacity = fit_blocks(
                offset, all_rests, blocks, mask.sink_size, window, align, dense_prompt
            )
        else:  # the packed block: a store's row is as wide as a packed row, or as the widest rest row if wider
            window_block, capacity = block_size, max([offset, *(r for stage in all_rests for r in stage)])
        stores = [[layers[j] for j in store] for store in split_stores([rest[layer] for layer in layers], capacity)]
        for i, store in enumerate(stores):
            at = 0
            for layer in store:  # a layer with no rest row: a column nothing reads, inside the page
                s = slots[layer]
                slots[layer] = LayerSlot(
                    s.layer, s.layout, s.packed_offset, s.packed_width, i, at if rest[layer] else 0, rest[layer]
                )
                at += rest[layer]
        window_row = max(max(1, sum(rest[layer] for layer in store)) for store in stores)
        if window_block * capacity > block_size * offset:  # a rest row wider than a packed page: so is every stage's
            window_row = capacity
        return cls(
            slots, offset, window_row, tuple(tuple(store) for store in stores), len(mine), head_dim, block_size,
            mask.sink_size, mask.recent_size, mask.accumu_size, dense_prompt, window_block,
        )  # fmt: skip

    @property
    def window(self) -> int:
        """Tokens before a query that it may score with every channel (besides the sink): recent + accumu."""
        return self.recent + self.accumu

    @property
    def page_elements(self) -> int:
        """Elements of one page of every store (the larger of the packed and the window content)."""
        return max(self.block_size * self.packed_row, self.window_block * self.window_row)

    def bytes_per_token(self, itemsize: int) -> float:
        """Packed bytes a token costs once it has left the window (all LeanK layers of the worker)."""
        return self.packed_row * itemsize


def split_stores(rests: list[int], capacity: int) -> list[list[int]]:
    """The layers (indices into ``rests``, the rest row of each, in order) of each window store: as many as fit in
    ``capacity`` elements per token, a new store where the next one does not fit."""
    stores: list[list[int]] = [[]]
    used = 0
    for i, r in enumerate(rests):
        if stores[-1] and used + r > capacity:
            stores.append([])
            used = 0
        stores[-1].append(i)
        used += r
    return stores


def steady_blocks(sink: int, window: int, block: int) -> int:
    """Window blocks a decoding request holds at most: its sink and two windows (the one it keeps, the one the step
    fills), as :meth:`~leank_infer.vllm.kv_specs.LeanKWindowSpec.steady_blocks` counts them."""
    return -(-sink // block) + 2 * (-(-window // block) + 1)


PACKED_BLOCK_STEP = 8  # a packed block the plugin picks is a multiple of this many tokens, at least 16
MIN_HASH_UNIT = 4  # tokens: vLLM hashes prompts at the blocks' gcd; a gcd of 1 takes ~40x plain's time on an 8k prompt


def fit_blocks(
    packed_row: int,
    rests: list[list[int]],
    packed_blocks: list[int],
    sink: int,
    window: int,
    align: int,
    dense_prompt: bool = True,
) -> tuple[int, int, int]:
    """(tokens per packed page, tokens per window page, elements per token of a window store) for a packed row of
    ``packed_row`` elements, the rest rows ``rests`` of every pipeline stage's layers, and a packed block among
    ``packed_blocks``.

    Every page in vLLM's pool is the same size, a packed page. A window store whose block holds as many tokens as a
    packed one holds whole layers' rest rows up to a packed row's width, and its last store is partly empty; a prompt
    token in flight pays for that (up to 1.5x a plain token). A window block of ``w`` tokens holds rows up to
    ``packed_block * packed_row / w`` wide instead, so the two block sizes together set how full the window pages are
    (``-s3``'s rest row is 1.6x its packed row: 40 and 24 tokens fill them to 98%). vLLM aligns prefix-cache hits to
    the least common multiple of the block sizes and hashes prompts at their greatest common divisor, so only pairs
    whose multiple is at most ``align`` tokens and whose divisor is at least :data:`MIN_HASH_UNIT` (or one block size;
    any divisor where no such pair holds a rest row) are taken, and only those whose stores cost a decoding request
    (sink and two windows) no more bytes than window pages of the packed block's size would. Under the
    ``dense-prompt`` rule the pair whose stores cost a prompt token in flight least is taken (within 1%: the fewest
    stores, then the fewest bytes a decoding request holds, then the finest hits); under the positional rule, where
    no prompt holds its rest rows, the fewest bytes a decoding request holds."""
    widest = max(r for stage in rests for r in stage)

    def cost(b: int, w: int) -> tuple[int, float, int] | None:
        page = max(b * packed_row, widest)
        capacity = page // w
        if capacity < 1 or widest > capacity:  # a page holds w whole rows
            return None
        stores = max(len(split_stores(stage, capacity)) for stage in rests)
        return stores, stores * page / w, stores * steady_blocks(sink, window, w) * page

    fits: dict[tuple[int, int], tuple[int, float, int]] = {}
    for unit in (MIN_HASH_UNIT, 1):  # finer hashing only where nothing else fits (rest rows many times a packed page)
        for b in packed_blocks:
            same = cost(b, b)
            for w in range(1, max(align, b) + 1):
                if math.lcm(w, b) > max(align, b) or (w != b and math.gcd(w, b) < unit):
                    continue
                c = cost(w=w, b=b)
                if c is not None and (same is None or c[2] <= same[2]):
                    fits[b, w] = c
        if fits:
            break
    if dense_prompt:
        best = min(c[1] for c in fits.values())
        near = [k for k, c in fits.items() if c[1] <= best * 1.01]
        key = lambda k: (fits[k][0], fits[k][2], math.lcm(*k), fits[k][1], -k[1])  # noqa: E731
    else:
        near = list(fits)
        key = lambda k: (fits[k][2], fits[k][0], math.lcm(*k), -k[1])  # noqa: E731
    b, w = min(near, key=key)
    return b, w, max(b * packed_row, widest) // w
