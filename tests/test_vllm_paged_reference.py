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
