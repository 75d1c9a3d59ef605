"""LeanK's binarisation: learned channel scores to a keep mask (docs/rule.md, "Binarisation")."""

from __future__ import annotations

from typing import Any

import torch

from .format import MaskError
from .layers import check_dense_layers


def check_ratio_align(ratio: float, align: int, head_dim: int) -> None:
    """Raise MaskError unless ``ratio`` is in [0, 1) and ``align`` is a positive divisor of ``head_dim``."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (0.0 <= float(ratio) < 1.0):
        raise MaskError(f"ratio must be a number in [0, 1) (the fraction of K channels pruned), got {ratio!r}")
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or head_dim % align != 0:
        raise MaskError(f"align must be a positive integer that divides head_dim={head_dim}, got {align!r}")


def _quantile(flat: torch.Tensor, q: float) -> torch.Tensor:
    """Linear-interpolation quantile of an already sorted 1-D tensor, without torch.quantile's 16M-element limit."""
    pos = q * (flat.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, flat.numel() - 1)
    return flat[lo] + (flat[hi] - flat[lo]) * (pos - lo)


def _counts(s: torch.Tensor, threshold: torch.Tensor, align: int) -> torch.Tensor:
    above = (s > threshold).sum(-1)
    return torch.floor(above.float() / align + 0.5).long().mul(align).clamp(0, s.shape[-1])


def binarize(
    scores: torch.Tensor, ratio: float, align: int, min_kept: int = 0, dense_layers: Any = ()
) -> torch.Tensor:
    """LeanK's binarisation (docs/rule.md, "Binarisation"): global quantile, per-head count rounded to ``align``, top-k.

    The threshold is the ``ratio``-quantile of all scores; a head keeps
    ``round(#scores above threshold / align) * align`` channels, namely its highest-scoring ones.
    Ties are broken by channel index, so the result is deterministic. ``dense_layers`` (sliding-window
    layers) keep every channel and take no part in the quantile: ``ratio`` is the pruned fraction of
    the layers LeanK prunes.

    ``min_kept > 0`` favours whole-head pruning: a head that would keep fewer than ``min_kept``
    channels keeps none (its V is then dropped too), and the channel budget it frees goes to the
    other heads (the threshold is the one whose total kept count is nearest the budget).
    """
    if scores.ndim != 3:
        raise MaskError(f"scores must be [layers, kv_heads, head_dim], got shape {tuple(scores.shape)}")
    head_dim = scores.shape[-1]
    check_ratio_align(ratio, align, head_dim)
    if not 0 <= min_kept <= head_dim:
        raise MaskError(f"min_kept must be in [0, head_dim={head_dim}], got {min_kept}")
    s = scores.detach().float().cpu()
    if not torch.isfinite(s).all():
        raise MaskError("scores contain NaN or inf; cannot binarise")
    dense = check_dense_layers(dense_layers, s.shape[0])
    pruned = [i for i in range(s.shape[0]) if i not in dense]
    if not pruned:
        raise MaskError("every layer is a dense (sliding-window) layer: LeanK has no global layer to prune")
    if not 0 <= min_kept <= head_dim:
        raise MaskError(f"min_kept must be in [0, head_dim={head_dim}], got {min_kept}")
    sp = s[pruned]
    flat = sp.flatten().sort().values
    counts_p = _counts(sp, _quantile(flat, ratio), align)
    if min_kept > 0:
        # the total kept falls as the threshold rises: bisect for the threshold whose total is nearest the budget
        budget = (1 - ratio) * sp.numel()

        def total(i: int) -> torch.Tensor:
            c = _counts(sp, flat[i], align)
            return c * (c >= min_kept)

        lo, hi = 0, flat.numel() - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if total(mid).sum() <= budget:
                hi = mid
            else:
                lo = mid + 1
        counts_p = total(lo)
        if lo > 0 and abs(total(lo - 1).sum() - budget) < abs(counts_p.sum() - budget):
            counts_p = total(lo - 1)
    counts = torch.full(s.shape[:2], head_dim, dtype=torch.long)
    counts[pruned] = counts_p
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(head_dim).expand_as(order).contiguous())
    keep = rank < counts.unsqueeze(-1)
    keep[list(dense)] = True
    return keep
