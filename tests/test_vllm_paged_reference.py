"""The paged PyTorch reference (what the vLLM kernels are tested against) is the rule over full K/V."""

from __future__ import annotations

import pytest
import torch
from vllm_pages import random_mask, random_pages, reference

from leank_infer.decode.masked_attention import leank_attention


@pytest.mark.parametrize(
    ("lengths", "counts", "q_heads"),
    [
        ([5, 17, 90, 97, 300], [3, 0, 64], 6),  # inside the sink, at the window's edges, long; a head keeping nothing
        ([81, 96, 97, 113, 700], [20, 7, 1], 3),  # MHA, every head keeps some
        ([250, 251, 252, 253], [0, 0, 0], 6),  # a layer keeping nothing: sink and window only
    ],
)
def test_paged_reference_is_the_positional_rule_over_full_kv(lengths, counts, q_heads):
    mask = random_mask(2, 3, 64, counts, seed=len(lengths))
    pages = random_pages(mask, lengths, layer=0, q_heads=q_heads)
    scale = 64**-0.5
    got = reference(pages, scale)
    keep = mask.keep[0].float()
    for b, n in enumerate(lengths):
        k = pages.keys[b].transpose(0, 1)[None]  # [1, Hkv, n, D]
        v = pages.values[b].transpose(0, 1)[None]
        q = pages.q[b][None, :, None]  # [1, Hq, 1, D]
        want = leank_attention(
            q, k, v, keep, torch.tensor([n - 1]), mask.sink_size, mask.recent_size, scale,
            skip_zero_heads=True, accumu_size=mask.accumu_size,
        )[0, 0]  # fmt: skip
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5, msg=f"request of {n} tokens")


@pytest.mark.parametrize(
    ("length", "cached", "counts", "q_heads", "dtype"),
    [
        (700, 0, [3, 0, 64], 6, torch.float32),  # a whole prompt; a head keeping nothing, one keeping all
        (700, 300, [20, 7, 1], 3, torch.float32),  # a later chunk: cached keys from the pages
        (90, 10, [3, 0, 64], 6, torch.float32),  # the first query inside the sink
        (600, 517, [0, 0, 0], 6, torch.float32),  # a layer keeping nothing: sink and window only
        (1100, 256, [5, 9, 0], 6, torch.bfloat16),  # several 256-query chunks inside SDPA, the model's dtype
    ],
)
def test_prefill_chunk_equals_the_reference(length, cached, counts, q_heads, dtype):
    """The backend's prompt-chunk attention (SDPA) gives what the paged reference gives, from any cached prefix."""
    from leank_infer.vllm.kernels import prefill
    from leank_infer.vllm.paged_reference import reference_attention, request_kv

    mask = random_mask(2, 3, 64, counts, seed=length)
    pages = random_pages(mask, [cached + 1], layer=0, q_heads=q_heads)  # the pages as the chunk finds them
    g = torch.Generator().manual_seed(cached)
    n = length - cached
    q = torch.randn(n, q_heads, 64, generator=g).to(dtype)
    kv = (torch.randn(n, 3, 64, generator=g).to(dtype), torch.randn(n, 3, 64, generator=g).to(dtype))
    tables = [  # grown by the chunk's own blocks (of each store's block size): NaN pages, never read
        torch.cat([t[0], torch.zeros(-(-length // pg.shape[1]), dtype=torch.int32)])[: -(-length // pg.shape[1])]
        for t, pg in ((pages.packed_table, pages.packed), (pages.window_table, pages.window))
    ]
    k, v = request_kv(pages.plan, pages.slot, pages.packed, tables[0], pages.window, tables[1], length, cached,
                      *kv, dtype)  # fmt: skip
    scale = 64**-0.5
    want = reference_attention(pages.plan, pages.slot, q, k, v, cached, scale)
    got = prefill(pages.plan, pages.slot, q, k, v, cached, scale)
    assert got.dtype == dtype and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("length", "cached", "fp8", "dtype"),
    [
        (700, 0, None, torch.float32),  # a whole prompt
        (700, 300, None, torch.float32),  # a later chunk: the earlier prompt's full rows from the window pages
        (2100, 1030, None, torch.bfloat16),  # several query chunks inside, the model's dtype
        (400, 250, "e4m3", torch.float32),  # fp8 pages: bytes scaled back
    ],
)
def test_dense_prompt_chunk_is_causal_attention_over_every_channel(length, cached, fp8, dtype):
    """The dense-prompt rule's prompt chunk (the window pages' full rows, then SDPA) is the model's causal
    attention over every key and channel, from any cached prefix; a middle key's dropped channels count."""
    from leank_infer.vllm.kernels import dense_prefill
    from leank_infer.vllm.paged_reference import request_kv

    mask = random_mask(2, 3, 64, [3, 0, 64], seed=length)
    pages = random_pages(mask, [max(cached, 1)], layer=0, q_heads=6, fp8=fp8, whole_window=True,
                         dtype=torch.float32 if fp8 else dtype)  # fmt: skip
    g = torch.Generator().manual_seed(cached)
    n = length - cached
    q = torch.randn(n, 6, 64, generator=g).to(dtype)
    new = (torch.randn(n, 3, 64, generator=g).to(dtype), torch.randn(n, 3, 64, generator=g).to(dtype))
    k, v = request_kv(pages.plan, pages.slot, pages.packed, pages.packed_table[0], pages.window, pages.window_table[0],
                      length, cached, *new, dtype, pages.k_scale, pages.v_scale, pages.fp8, whole=True)  # fmt: skip
    keys = torch.cat([pages.keys[0][:cached].to(dtype), new[0]]).float()
    values = torch.cat([pages.values[0][:cached].to(dtype), new[1]]).float()
    torch.testing.assert_close(k.float(), keys)
    scale = 64**-0.5
    got = dense_prefill(q, k, v, cached, scale, q_chunk=512)
    # the rule over full K/V with every channel kept: every key whole, causal
    want = leank_attention(
        q.float().transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        torch.ones(3, 64), torch.arange(cached, length), mask.sink_size, mask.recent_size, scale,
        accumu_size=mask.accumu_size,
    )[0]  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    pruned = leank_attention(
        q.float().transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        mask.keep[0].float(), torch.arange(cached, length), mask.sink_size, mask.recent_size, scale,
        skip_zero_heads=True, accumu_size=mask.accumu_size,
    )[0]  # fmt: skip
    assert not torch.allclose(got.float(), pruned, rtol=tol, atol=tol)
