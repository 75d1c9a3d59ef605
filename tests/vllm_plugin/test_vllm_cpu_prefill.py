"""The dense-prompt prefill on vLLM's CPU build (leank_infer/vllm/cpu_prefill.py): a step's prompt chunks, their
earlier prompt tokens in LeanK's pages (tests/vllm_pages.py: NaN wherever nothing was written, blocks shuffled and
strided), attended in one call of vLLM's CPU kernel, against causal attention over the dense K/V in float64."""

from __future__ import annotations

import math

import pytest
import torch
from vllm_pages import random_mask, random_pages

from leank_infer.vllm import cpu_prefill, kernels

EMBEDDED = dict(sink_size=16, recent_size=64, accumu_size=16)
SCALE = 0.125
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int) -> torch.Tensor:
    """Queries ``[n, Hq, D]`` at positions ``first + i`` over keys ``[first + n, Hkv, D]``, every channel, float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    allowed = torch.arange(k.shape[0])[None] <= torch.arange(first, first + q.shape[0])[:, None]
    weights = scores.masked_fill(~allowed, -math.inf).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def step(
    lengths: list[int], chunks: list[tuple[int, int, int]], gap: int, dtype, fp8, seed: int, window_block=None,
    block_size: int = 16,
):  # noqa: ANN001
    """Pages of requests whose prompts are ``lengths`` long, and a step of ``2 + sum(n) + gap`` tokens: two decode
    tokens, then for each ``(request, cached, n)`` its chunk of ``n`` prompt queries after ``cached`` tokens (``gap``
    tokens of other work after the first chunk). The chunks' own K/V are not the pages': the step's are used. The
    window pages hold the plan's tokens per block (16 for this mask, as the packed pages do) unless ``window_block``; the
    packed pages ``block_size``."""
    mask = random_mask(2, 3, 64, [32, 0, 64, 7], seed=seed, **EMBEDDED)
    pg = random_pages(mask, lengths, layer=1, q_heads=9, block_size=block_size, dtype=dtype, fp8=fp8, seed=seed,
                      whole_window=True, window_block=window_block)  # fmt: skip
    g = torch.Generator().manual_seed(seed + 1)
    total = 2 + sum(n for _, _, n in chunks) + gap
    q = torch.randn(total, 9, 64, generator=g).to(pg.q.dtype)
    k = torch.randn(total, 3, 64, generator=g).to(pg.q.dtype)
    v = torch.randn(total, 3, 64, generator=g).to(pg.q.dtype)
    rows, start = [], 2
    for i, (request, cached, n) in enumerate(chunks):
        rows.append((request, start, start + n, cached))
        start += n + (gap if i == 0 else 0)
    return pg, q, k, v, rows


@pytest.fixture(params=["direct", "buffer"])
def path(request, monkeypatch):
    """How the earlier tokens reach the scratch: the library's gather straight into vLLM's page layout, or (where vLLM
    lays its pages out otherwise: AMX, NEON) gathered rows written by vLLM's own reshape_and_cache."""
    if request.param == "buffer":
        monkeypatch.setattr(cpu_prefill, "vllm_layout_is_known", lambda *a: False)
    return request.param


def planned(path, monkeypatch, fp8, *args) -> cpu_prefill.PromptBatch:  # noqa: ANN001
    """``plan_prompts(*args)``; on the direct path (where this CPU's vLLM has the layout) nothing may take the buffer."""
    batch = cpu_prefill.plan_prompts(*args)
    if path == "direct" and not batch.direct:
        pytest.skip("vLLM lays this CPU's pages out otherwise (AMX or NEON): only the buffer path runs here")
    if path == "direct" and fp8 is None:  # fp8 pages need their scales: PyTorch's gather, through the buffer
        monkeypatch.setattr(kernels, "prompt_rows", lambda *a: pytest.fail("the buffer path ran"))
    assert batch.direct == (path == "direct")
    return batch


@pytest.mark.parametrize(
    "dtype, fp8", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "e4m3")], ids=["fp32", "bf16", "fp8"]
)
@pytest.mark.parametrize("gap", [0, 3], ids=["one-run", "apart"])
@pytest.mark.parametrize("blocks", [(16, None), (40, 24)], ids=["pages-16", "pages-40-24"])
def test_a_steps_prompt_chunks_attend_as_the_model(dtype, fp8, gap, blocks, path, monkeypatch):
    """Chunks after 0, 1, 37 and 300 cached prompt tokens (a one-token chunk among them), in one step, in one run of
    the step's tokens or apart: each query equals causal attention over its request's earlier tokens (every channel,
    from the pages) and the step's own K/V; every other row of the output stays as it was. Over 16-token pages, and
    over 40-token packed and 24-token window pages (``-s3``'s on CPU: 160-token scratch blocks)."""
    lengths = [40, 350, 100, 30]
    chunks = [(1, 300, 50), (0, 37, 1), (2, 0, 100), (3, 1, 20)]
    pg, q, k, v, rows = step(lengths, chunks, gap, dtype, fp8, seed=3, window_block=blocks[1], block_size=blocks[0])
    batch = planned(path, monkeypatch, fp8, rows, pg.packed_table, blocks[0], 9, 3, 64, q.dtype)
    assert isinstance(batch.tokens, slice) == (gap == 0)
    bound = kernels.BoundLayer(pg.plan, pg.slot, pg.packed, pg.window, q.dtype, SCALE, pg.k_scale, pg.v_scale, pg.fp8)
    out = torch.full_like(q, 5.0)
    cpu_prefill.attend(batch, bound, q, k, v, out, pg.packed_table, pg.window_table)
    done = torch.zeros(q.shape[0], dtype=torch.bool)
    for request, start, end, cached in rows:
        keys = torch.cat([pg.keys[request][:cached].to(q.dtype), k[start:end]])
        values = torch.cat([pg.values[request][:cached].to(q.dtype), v[start:end]])
        want = causal(q[start:end], keys, values, cached)
        torch.testing.assert_close(out[start:end].double(), want, atol=TOL[dtype], rtol=TOL[dtype])
        done[start:end] = True
    assert (out[~done] == 5.0).all()


class _DirtyTorch:
    """``torch`` whose ``empty`` hands out NaN (memory an allocator reuses holds anything)."""

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, dtype=None, **kw) -> torch.Tensor:  # noqa: ANN001
        return torch.full(shape[0] if len(shape) == 1 else shape, math.nan, dtype=dtype, **kw)


def test_the_layers_of_a_step_share_one_scratch(path, monkeypatch):
    """A step's scratch is allocated once and every layer reuses it: its pad slots are zeroed once, so the allocator's
    dirt (NaN) never reaches an output; a layer over other pages gives its own attention, and the first layer again
    gives its first output bit for bit (nothing of a layer stays in the scratch for the next)."""
    lengths, chunks = [40, 350, 100, 30], [(1, 300, 50), (0, 37, 1), (2, 0, 100), (3, 1, 20)]
    pg, q, k, v, rows = step(lengths, chunks, 0, torch.float32, None, seed=3)
    other = step(lengths, chunks, 0, torch.float32, None, seed=4)[0]  # another layer's pages (their own tables)
    monkeypatch.setattr(cpu_prefill, "torch", _DirtyTorch())
    batch = planned(path, monkeypatch, None, rows, pg.packed_table, 16, 9, 3, 64, q.dtype)
    monkeypatch.setattr(cpu_prefill, "torch", torch)
    assert batch.pad_slots.numel() and batch.scratch.isnan().any()  # dirt where the gathers will write
    outs = []
    for pages in (pg, other, pg):
        bound = kernels.BoundLayer(pages.plan, pages.slot, pages.packed, pages.window, q.dtype, SCALE)
        out = torch.zeros_like(q)
        cpu_prefill.attend(batch, bound, q, k, v, out, pages.packed_table, pages.window_table)
        for request, start, end, cached in rows:
            keys = torch.cat([pages.keys[request][:cached], k[start:end]])
            values = torch.cat([pages.values[request][:cached], v[start:end]])
            want = causal(q[start:end], keys, values, cached)
            torch.testing.assert_close(out[start:end].double(), want, atol=2e-5, rtol=2e-5)
        outs.append(out)
    assert torch.equal(outs[0], outs[2]) and not torch.allclose(outs[0], outs[1])


def test_each_request_reads_its_own_blocks():
    """Two requests with the same earlier length and different pages: swapping their tables swaps their outputs (the
    gather follows each request's row of the tables, the scratch keeps the requests apart)."""
    pg, q, k, v, rows = step([64, 64], [(0, 48, 8), (1, 48, 8)], 0, torch.float32, None, seed=5)
    batch = cpu_prefill.plan_prompts(rows, pg.packed_table, 16, 9, 3, 64, q.dtype)
    bound = kernels.BoundLayer(pg.plan, pg.slot, pg.packed, pg.window, q.dtype, SCALE)
    out, swapped = torch.zeros_like(q), torch.zeros_like(q)
    cpu_prefill.attend(batch, bound, q, k, v, out, pg.packed_table, pg.window_table)
    cpu_prefill.attend(batch, bound, q, k, v, swapped, pg.packed_table.flip(0), pg.window_table.flip(0))
    for request, other in ((0, 1), (1, 0)):
        start, end, cached = rows[request][1], rows[request][2], rows[request][3]
        keys = torch.cat([pg.keys[other][:cached], k[start:end]])
        values = torch.cat([pg.values[other][:cached], v[start:end]])
        torch.testing.assert_close(swapped[start:end].double(), causal(q[start:end], keys, values, cached), atol=2e-5,
                                   rtol=2e-5)  # fmt: skip
    assert not torch.allclose(out[2:18], swapped[2:18])


def test_requests_sharing_a_cached_prefix_share_its_scratch_blocks(path, monkeypatch):
    """Requests whose tables share their first pages (a prefix-cache hit) gather those tokens once, into scratch blocks
    they all read; the tokens after the shared pages each request gathers itself; every query still equals causal
    attention over its own request's tokens. Window pages of 8 tokens (vLLM hits a prefix at a multiple of both block
    sizes: 16 here)."""
    pg, q, k, v, rows = step([300, 300, 300], [(0, 256, 10), (1, 256, 20), (2, 200, 5)], 0, torch.float32, None, 7, 8)
    packed_table, window_table = pg.packed_table.clone(), pg.window_table.clone()
    for request, tokens in ((1, 256), (2, 128)):  # request 1 shares 256 tokens with request 0, request 2 128
        packed_table[request, : tokens // 16] = packed_table[0, : tokens // 16]
        window_table[request, : tokens // 8] = window_table[0, : tokens // 8]
    batch = planned(path, monkeypatch, None, rows, packed_table, 16, 9, 3, 64, q.dtype)
    assert batch.earlier == 256 + 72 and batch.gathers == ((0, 0, 256, 0), (2, 128, 72, 256))
    assert [b.tolist() for b in batch.gather_blocks] == [[0, 1], [4]]  # request 0's two blocks; request 2's third
    bound = kernels.BoundLayer(pg.plan, pg.slot, pg.packed, pg.window, q.dtype, SCALE)
    out = torch.zeros_like(q)
    cpu_prefill.attend(batch, bound, q, k, v, out, packed_table, window_table)
    owner = {0: [(0, 256)], 1: [(0, 256)], 2: [(0, 128), (2, 200)]}  # whose keys each request's earlier tokens are
    for request, start, end, cached in rows:
        parts, at = [], 0
        for source, upto in owner[request]:
            parts.append(pg.keys[source][at:upto])
            at = upto
        keys = torch.cat([*parts, k[start:end]])
        parts, at = [], 0
        for source, upto in owner[request]:
            parts.append(pg.values[source][at:upto])
            at = upto
        values = torch.cat([*parts, v[start:end]])
        torch.testing.assert_close(out[start:end].double(), causal(q[start:end], keys, values, cached), atol=2e-5,
                                   rtol=2e-5)  # fmt: skip


def test_the_batch_lays_each_request_out_in_whole_blocks():
    """The scratch: one run of whole blocks per request (128 tokens: eight pages of 16), earlier tokens then the
    chunk's, then zeros to the block's end, the lengths vLLM's kernel reads; a whole block of earlier tokens whose pages
    another request's block has is that block; the gather runs follow the requests in order."""
    pages = torch.arange(6 * 20, dtype=torch.int32).view(6, 20) + 1  # every request its own pages...
    pages[5, :8] = pages[0, :8]  # ...but request 5's first 128 tokens are request 0's
    chunks = [(4, 10, 12, 130), (2, 12, 112, 0), (0, 200, 201, 256), (5, 301, 302, 128)]
    batch = cpu_prefill.plan_prompts(chunks, pages, 16, 9, 3, 64, torch.float32)
    assert batch.block_size == 128 and batch.num_blocks == 2 + 1 + 3 + 1
    assert batch.tokens.tolist() == [*range(10, 112), 200, 301]  # not one run: an index
    assert batch.query_start_loc.tolist() == [0, 2, 102, 103, 104]
    assert batch.seq_lens.tolist() == [132, 100, 257, 129]
    assert batch.gathers == ((4, 0, 130, 0), (0, 0, 256, 130))
    assert [b.tolist() for b in batch.gather_blocks] == [[0, 1], [3, 4]]
    assert batch.block_table.tolist() == [[0, 1, 0], [2, 0, 0], [3, 4, 5], [3, 6, 0]]
    assert batch.earlier_slots.tolist() == [*range(0, 130), *range(384, 640)]
    assert batch.query_slots.tolist() == [130, 131, *range(256, 356), 640, 768]
    assert batch.pad_slots.tolist() == [*range(132, 256), *range(356, 384), *range(641, 768), *range(769, 896)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_the_page_layout_is_vllms_own(dtype, head_dim, monkeypatch):
    """cpu_prefill.pages reads a block as vLLM's vec and vec16 kernels write it (asked of vLLM's reshape_and_cache);
    a layout read otherwise (K not transposed) is not taken for vLLM's, so such a CPU takes the buffer path."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, 128, head_dim, "auto")
    cpu_prefill.vllm_layout_is_known.cache_clear()
    assert cpu_prefill.vllm_layout_is_known(isa, dtype, 128, head_dim) == (isa in ("vec", "vec16"))
    rows = lambda s: (s[:, :, : s.shape[2] // 2], s[:, :, s.shape[2] // 2 :])  # noqa: E731 - K rows, not transposed
    monkeypatch.setattr(cpu_prefill, "pages", rows)
    cpu_prefill.vllm_layout_is_known.cache_clear()
    assert not cpu_prefill.vllm_layout_is_known(isa, dtype, 128, head_dim)
    cpu_prefill.vllm_layout_is_known.cache_clear()


@pytest.mark.parametrize("page_block", [1, 8, 16, 24, 40, 56, 128, 200])
def test_a_scratch_block_is_whole_pages_and_what_vllms_kernel_takes(page_block):
    """The scratch over LeanK's pages of any block size the plugin may pick: a block of whole LeanK pages (shared
    blocks are keyed by the pages they copy), a multiple of 32 tokens (vLLM's CPU kernel), at least vLLM's CPU default
    of 128, and no larger than that needs (a larger block pads every request's last one)."""
    from leank_infer.vllm.cpu_prefill import scratch_block

    def fits(n: int) -> bool:
        return n % page_block == 0 and n % 32 == 0 and n >= 128

    got = scratch_block(page_block)
    assert fits(got) and not any(fits(n) for n in range(1, got))
