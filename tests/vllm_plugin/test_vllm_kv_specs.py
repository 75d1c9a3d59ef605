"""The window pages' manager in vLLM's own block pool: the sink stays, the gap is never held, hits need the sink."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.utils.math_utils import cdiv  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from leank_infer.vllm.kv_specs import LeanKWindowManager, LeanKWindowSpec, register  # noqa: E402

BS, SINK, WINDOW = 16, 16, 80  # the embedded masks: sink 16, recent 64 + accumu 16


def spec(sink: int = SINK, dense_prompt: bool = False) -> LeanKWindowSpec:
    import torch

    return LeanKWindowSpec(
        block_size=BS, num_kv_heads=3, head_size=64, dtype=torch.float32, sliding_window=WINDOW, sink_len=sink,
        dense_prompt=dense_prompt,
    )  # fmt: skip


def manager(num_blocks: int = 200, caching: bool = True, sink: int = SINK, dense_prompt: bool = False) -> LeanKWindowManager:
    register()
    pool = BlockPool(num_blocks, enable_caching=caching, hash_block_size=BS)
    return LeanKWindowManager(
        spec(sink, dense_prompt), block_pool=pool, enable_caching=caching, kv_cache_group_id=0, scheduler_block_size=BS
    )


def real(blocks) -> list[int]:
    return [i for i, b in enumerate(blocks) if not b.is_null]


def step(m: LeanKWindowManager, rid: str, computed: int, n: int, prompt: int | None = None) -> int:
    """One scheduler step of ``n`` tokens after ``computed``: free, count, allocate (as vLLM's coordinator)."""
    m.remove_skipped_blocks(rid, computed, prompt)
    want = m.get_num_blocks_to_allocate(rid, computed + n, [], computed, 0, computed + n)
    free = m.block_pool.get_num_free_blocks()
    got = m.allocate_new_blocks(rid, computed + n, computed + n)
    assert free - m.block_pool.get_num_free_blocks() == want == sum(not b.is_null for b in got)
    return want


def test_a_long_prefill_chunk_holds_only_the_sink_and_the_next_window():
    m = manager()
    m.num_cached_block["r"] = 0  # a running request (vLLM's fast path)
    step(m, "r", 0, 1000)
    blocks = m.req_to_blocks["r"]
    assert len(blocks) == cdiv(1000, BS)
    first_window = (1000 - WINDOW + 1) // BS  # the next query (position 1000) reads from 921 on
    assert real(blocks) == [0, *range(first_window, len(blocks))]


@pytest.mark.parametrize("prompt", [300, 20])  # a gap from the start, or one that opens while decoding
def test_decoding_frees_the_gap_and_keeps_the_sink(prompt):
    m = manager()
    m.num_cached_block["r"] = 0
    step(m, "r", 0, prompt)
    for p in range(prompt, 500):
        step(m, "r", p, 1)
        blocks = m.req_to_blocks["r"]
        kept = real(blocks)
        assert kept[0] == 0  # the sink block
        # every position a query at p + 1 scores with every channel is in a real block
        lo = max(SINK, p + 1 - WINDOW + 1)
        assert all(not blocks[q // BS].is_null for q in range(lo, p + 1))
        # and nothing but the sink and that window is held
        assert len(kept) <= 1 + cdiv(WINDOW, BS) + 1
    assert len(kept) <= m.kv_cache_spec.max_admission_blocks_per_request(8192, 4096)


def test_a_sink_larger_than_a_block_stays_whole():
    m = manager(sink=40)
    m.num_cached_block["r"] = 0
    step(m, "r", 0, 500)
    for p in range(500, 540):
        step(m, "r", p, 1)
    assert real(m.req_to_blocks["r"])[:3] == [0, 1, 2]


def test_freeing_a_request_returns_every_block():
    m = manager(num_blocks=50)
    before = m.block_pool.get_num_free_blocks()
    m.num_cached_block["r"] = 0
    step(m, "r", 0, 400)
    step(m, "r", 400, 1)
    m.free("r")
    assert m.block_pool.get_num_free_blocks() == before


def _cache(m: LeanKWindowManager, hashes: list[bytes], which: list[int]) -> None:
    """Register blocks ``which`` of a request as cached under ``hashes`` (as cache_full_blocks would)."""
    pool = m.block_pool
    for i in which:
        block = pool.get_new_blocks(1)[0]
        pool._insert_block_hash(make_block_hash_with_group_id(hashes[i], 0), block, BS)
        pool.free_blocks([block])  # cached but free: an eviction candidate, as after a request finished


def _hit(m: LeanKWindowManager, hashes: list[bytes], max_length: int) -> tuple[list, int]:
    computed, length = LeanKWindowManager.find_longest_cache_hit(
        hashes, max_length, [0], m.block_pool, m.kv_cache_spec, False, BS
    )
    return computed[0], length


def test_a_hit_needs_the_sink_and_the_window_before_it():
    m = manager()
    hashes = [bytes([i]) * 32 for i in range(40)]
    _cache(m, hashes, list(range(40)))
    blocks, length = _hit(m, hashes, 40 * BS)
    assert length == 40 * BS
    assert not blocks[0].is_null  # the sink is part of the hit
    assert all(not blocks[i].is_null for i in range(40 - cdiv(WINDOW - 1, BS), 40))


def test_a_hit_without_the_sink_shrinks_to_what_is_cached_from_the_start():
    """The window before the boundary is cached but the sink block was evicted: no window-only hit."""
    m = manager()
    hashes = [bytes([i]) * 32 for i in range(40)]
    _cache(m, hashes, list(range(30, 40)))  # the sliding-window manager alone would hit at 40 blocks
    blocks, length = _hit(m, hashes, 40 * BS)
    assert length == 0 and blocks == []
    m2 = manager()
    _cache(m2, hashes, [0, 1, 2, *range(30, 40)])
    _, length = _hit(m2, hashes, 40 * BS)
    assert length == 40 * BS  # sink (block 0) and the window: a hit


def test_adding_a_hit_keeps_sink_and_window_and_touches_only_them():
    m = manager()
    hashes = [bytes([i]) * 32 for i in range(40)]
    _cache(m, hashes, list(range(40)))
    blocks, length = _hit(m, hashes, 40 * BS)
    free = m.block_pool.get_num_free_blocks()
    m.add_local_computed_blocks("r", blocks, length, 0)
    held = real(m.req_to_blocks["r"])
    assert held[0] == 0 and held[1:] == list(range((length - WINDOW + 1) // BS, 40))
    # cached free blocks the request now holds left the free queue: only sink + window
    assert free - m.block_pool.get_num_free_blocks() == len(held)


@pytest.mark.parametrize("junction", [600, 608, 40])  # inside a block, on a boundary, inside the first window
def test_the_window_before_a_shared_prefix_junction_is_kept(junction):
    """A request that shares a prefix the window pages do not cover (vLLM's ``shared_prefix_boundary``):
    the blocks of the window ending at the junction become real in the step that computes them, in the list
    the worker receives, so a later request hits there; nothing else changes."""
    from types import SimpleNamespace

    m = manager()
    m.num_cached_block["r"] = 0
    step(m, "r", 0, 1000)
    new = m._step_blocks["r"]
    before = real(m.req_to_blocks["r"])
    free = m.block_pool.get_num_free_blocks()
    m._keep_junction_window(SimpleNamespace(request_id="r", shared_prefix_boundary=junction), 1000)
    blocks = m.req_to_blocks["r"]
    end = junction // BS  # the hit can only be block-aligned: the window ends at the block boundary below
    tail = [i for i in range(max(1, max(0, end * BS - WINDOW + 1) // BS), end) if i not in before]
    assert real(blocks) == sorted({*before, *tail})
    assert free - m.block_pool.get_num_free_blocks() == len(tail)
    assert [b.block_id for b in new] == [b.block_id for b in blocks]  # the worker's list sees them
    if junction > WINDOW:
        assert len(tail) == cdiv(WINDOW - 1, BS)  # what a sliding-window hit needs before its boundary
    m._keep_junction_window(SimpleNamespace(request_id="r", shared_prefix_boundary=junction), 1000)
    assert free - m.block_pool.get_num_free_blocks() == len(tail)  # once per allocation, not again


def test_no_junction_window_when_the_pool_is_short_or_the_blocks_are_older():
    from types import SimpleNamespace

    m = manager(num_blocks=12)
    m.num_cached_block["r"] = 0
    step(m, "r", 0, 1000)  # sink + the next window: 1 + 6 of 11 usable blocks
    left = m.block_pool.get_num_free_blocks()
    m.block_pool.get_new_blocks(left - 2)  # someone else holds the rest: 2 free, the tail needs 5
    m._keep_junction_window(SimpleNamespace(request_id="r", shared_prefix_boundary=600), 1000)
    assert m.block_pool.get_num_free_blocks() == 2
    m2 = manager()
    m2.num_cached_block["r"] = 0
    step(m2, "r", 0, 700)
    step(m2, "r", 700, 300)  # the junction's window (blocks 32-36) was allocated, as nulls, a step before
    free = m2.block_pool.get_num_free_blocks()
    m2._keep_junction_window(SimpleNamespace(request_id="r", shared_prefix_boundary=600), 1000)
    assert m2.block_pool.get_num_free_blocks() == free


# ---- the dense-prompt rule: every prompt block while the prompt is computed ----------------------------------
@pytest.mark.parametrize("length", [4096, 1000, 40])
@pytest.mark.parametrize("chunk", [4096, 512, 100])
def test_the_admission_count_is_the_most_a_request_holds(length, chunk):
    """max_admission_blocks_per_request is exact: a prompt of max_model_len - 1 tokens, chunked, then decoded to
    max_model_len, never holds more blocks than it, and holds that many at some step (a shorter max_model_len: the
    decode window's own peak)."""
    m = manager(num_blocks=600, dense_prompt=True)
    m.num_cached_block["r"] = 0
    prompt = length - 1
    held = []
    for c in range(0, prompt, chunk):
        step(m, "r", c, min(chunk, prompt - c), prompt)
        held.append(len(real(m.req_to_blocks["r"])))
    for p in range(prompt, length):
        step(m, "r", p, 1, prompt)
        held.append(len(real(m.req_to_blocks["r"])))
    assert max(held) <= m.kv_cache_spec.max_admission_blocks_per_request(8192, length)
    if length > WINDOW * 4:
        assert max(held) == m.kv_cache_spec.max_admission_blocks_per_request(8192, length)



@pytest.mark.parametrize("chunk", [1000, 256, 100])
def test_a_dense_prompt_is_held_whole_until_it_is_computed_then_only_sink_and_window(chunk):
    """Chunked or not, every block of the prompt is real while it is computed (later chunks read the earlier
    ones' full rows); once it is, the gap is freed and decoding holds what the positional rule holds."""
    m = manager(dense_prompt=True)
    m.num_cached_block["r"] = 0
    prompt = 1000
    for c in range(0, prompt, chunk):
        step(m, "r", c, min(chunk, prompt - c), prompt)
        assert real(m.req_to_blocks["r"]) == list(range(cdiv(min(c + chunk, prompt), BS)))
    for p in range(prompt, prompt + 40):
        step(m, "r", p, 1, prompt)
        blocks = m.req_to_blocks["r"]
        lo = max(SINK, p + 1 - WINDOW + 1)
        assert real(blocks)[0] == 0 and all(not blocks[q // BS].is_null for q in range(lo, p + 1))
        assert len(real(blocks)) <= 1 + cdiv(WINDOW, BS) + 1
    spec_ = m.kv_cache_spec
    assert spec_.max_admission_blocks_per_request(8192, 4096) >= cdiv(4096, BS)  # a whole prompt is admitted
    assert spec_.steady_blocks(4096) == manager().kv_cache_spec.max_admission_blocks_per_request(8192, 4096)


def test_a_dense_prompt_caches_prompt_blocks_only_and_hits_from_the_start():
    """Blocks holding a generated token are never cached (a later prompt computes them densely); a hit is the
    run of cached blocks from the first one, and it keeps every one of them."""
    from types import SimpleNamespace

    m = manager(dense_prompt=True)
    hashes = [bytes([i]) * 32 for i in range(40)]
    req = SimpleNamespace(request_id="r", num_prompt_tokens=300, block_hashes=hashes, num_tokens=340,
                          shared_prefix_boundary=0)
    m.num_cached_block["r"] = 0
    step(m, "r", 0, 300, 300)
    m.cache_blocks(req, 300, replay_boundaries=())  # vLLM caches right after each allocation
    step(m, "r", 300, 40, 300)
    m.cache_blocks(req, 340, replay_boundaries=())
    assert m.num_cached_block["r"] == 300 // BS  # the block holding tokens 288-303 is partly generated
    m.free("r")
    got, length = _hit(m, hashes, 600)
    assert length == 300 // BS * BS and len(got) == 300 // BS
    m2 = manager(dense_prompt=True)
    _cache(m2, hashes, [0, 1, 2, 4, 5])  # a gap at block 3: the hit stops there
    assert _hit(m2, hashes, 600)[1] == 3 * BS
    # the sink and a window, a gap between: the positional rule's hit covers it all, this one only the sink block
    dense, positional = manager(dense_prompt=True), manager()
    for m3 in (dense, positional):
        _cache(m3, hashes, [0, *range(10, 18)])
    assert _hit(dense, hashes, 18 * BS)[1] == BS and _hit(positional, hashes, 18 * BS)[1] == 18 * BS
    m2.remove_skipped_blocks("s", 0, 500)
    computed, _ = LeanKWindowManager.find_longest_cache_hit(hashes, 600, [0], m2.block_pool, m2.kv_cache_spec, False, BS)
    m2.add_local_computed_blocks("s", computed[0], 3 * BS, 0)
    assert real(m2.req_to_blocks["s"]) == [0, 1, 2]


@pytest.mark.parametrize("dense_prompt", [False, True], ids=["positional", "dense-prompt-done"])
def test_blocks_held_are_exactly_the_sink_and_the_next_querys_window_at_every_length(dense_prompt):
    """After ``n`` tokens, block ``i`` is real iff it holds a sink token or a position the next query (at ``n``)
    reads with every channel, ``n - WINDOW + 1 .. n - 1``: counted over two blocks' worth of lengths, so the lengths
    where that window starts on a block boundary (one block fewer) are among them; a decode step after it holds that
    window and the new token (the step frees before it allocates).
    Under dense-prompt the prompt is done here (computed earlier, 16 tokens), so the rule is the same."""
    for n in range(600, 600 + 2 * BS + 1):
        m = manager(dense_prompt=dense_prompt)
        m.num_cached_block["r"] = 0
        prompt = 16 if dense_prompt else None
        if dense_prompt:
            step(m, "r", 0, 16, prompt)
            step(m, "r", 16, n - 16)
        else:
            step(m, "r", 0, n)
        want = sorted({q // BS for q in [*range(SINK), *range(n - WINDOW + 1, n)]})
        assert real(m.req_to_blocks["r"]) == want, n
        step(m, "r", n, 1)  # a decode step: what the query at n read stays until the next step frees it, plus n
        want = sorted({q // BS for q in [*range(SINK), *range(n - WINDOW + 1, n + 1)]})
        assert real(m.req_to_blocks["r"]) == want, n
