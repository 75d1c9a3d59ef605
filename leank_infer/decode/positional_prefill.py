"""The prompt's attention under the positional rule: every prompt query by the LeanK rule, over the prompt's own K/V.

Under ``rule="positional"`` (:func:`~leank_infer.decode.rule.positional_recent_from`) the forward that fills an
empty LeanK layer is not dense: a prompt query at position p scores its middle keys with the kept channels, as
every later query does. The K/V are still whole here (the attention of that forward reads the K/V the cache was
given, before compression), so this computes the rule of
:func:`~leank_infer.decode.masked_attention.leank_attention` (``accumu_size=...``, ``skip_zero_heads=True``) with
the model's own mask on top, never building a ``[keys x keys]`` matrix. Per chunk of queries, only keys in the
head (every row's sink) and in a band from the chunk's lowest ``recent_from`` on can be scored with all channels;
the rest are middle keys for every query of the chunk. So the chunk attends, in one SDPA call, to those few keys
whole followed by every key with its dropped channels zeroed, a mask choosing for each query one copy of each
key: about 1.5x the cost of the model's dense SDPA. A soft-capped model (Gemma 2; SDPA cannot soft-cap) takes
explicit scores instead: the kept-channel product over every key, full-channel products over head and band.
"""

from __future__ import annotations

import torch

from .layout import allowed_from_mask
from .rule import attended, gqa_view, key_regions, row_recent_from
from .torch_decode import finish, masked, partial, scores

_NEG_INF = float("-inf")


def positional_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keep: torch.Tensor,
    starts: torch.Tensor,
    sink_size: int,
    recent_size: int,
    accumu_size: int,
    scaling: float,
    softcap: float | None = None,
    attention_mask: torch.Tensor | None = None,
    q_chunk: int = 256,
) -> torch.Tensor:
    """LeanK attention of the last ``Q`` positions over all ``K`` keys by the positional rule; ``[B, Q, Hq, Dv]``.

    Args:
        query: ``[B, Hq, Q, D]``; key, value: ``[B, Hkv, K, D]`` (post-RoPE, key j at padded position j; the
            queries are the last ``Q`` positions).
        keep: ``[Hkv, D]`` bool, the channels middle keys are scored with; a head keeping none skips them.
        starts: ``[B]`` each row's first real token (left padding): positions count from there.
        attention_mask: the model's mask (4-D bool/float, 2-D padding, or None for causal), applied on top.
        q_chunk: queries per step (memory is ``[B, Hq, q_chunk, K]`` fp32 scores).
    """
    hkv, d = key.shape[1], query.shape[-1]
    if keep.shape != (hkv, d):
        raise ValueError(f"keep must be [{hkv}, {d}], got {tuple(keep.shape)}")
    run = _by_scores if softcap is not None else _by_sdpa
    return run(query, key, value, keep.to(query.device), starts.to(query.device).long(), sink_size, recent_size,
               accumu_size, scaling, softcap, attention_mask, q_chunk)


def _chunks(q_len: int, k_len: int, q_chunk: int):
    """``(s, e, kend)`` per chunk of queries ``[s, e)``; ``kend``: no query of the chunk sees a key past it."""
    first = k_len - q_len  # padded position of the first query
    for s in range(0, q_len, q_chunk):
        e = min(q_len, s + q_chunk)
        yield s, e, first + e


def _regions(keys: torch.Tensor, p: torch.Tensor, row: torch.Tensor, sink_size: int, rf: torch.Tensor,
             allowed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible, middle) ``[B, c, n]`` of ``keys`` for the chunk's queries, the model's mask ``allowed`` on top."""
    visible, middle = key_regions(keys.view(1, 1, -1), p, row, sink_size, rf)
    if allowed is not None:
        visible = visible & allowed
        middle = middle & visible
    return visible, middle


def _by_sdpa(query, key, value, keep, row_starts, sink_size, recent_size, accumu_size, scaling, softcap,
             attention_mask, q_chunk):
    """One SDPA call per chunk and set of heads (those keeping channels; those keeping none, which skip their
    middle keys), over ``[few keys whole | every key with its dropped channels zeroed]``. The heads are put in
    that order once (each set a slice) and back at the end."""
    b, hq, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    g = hq // hkv
    device = query.device
    row = row_starts.view(b, 1, 1)
    allowed = None if attention_mask is None else allowed_from_mask(attention_mask, k_len, q_len, device)
    head_end = min(k_len, int(row.max()) + sink_size)  # every row's sink lies below this
    nonzero = keep.any(-1)
    n_keep = int(nonzero.sum())
    order = torch.cat([nonzero.nonzero().flatten(), (~nonzero).nonzero().flatten()])
    q_order = (order.view(-1, 1) * g + torch.arange(g, device=device)).flatten()
    shuffled = not torch.equal(order, torch.arange(hkv, device=device))
    if shuffled:
        query, key, value = query.index_select(1, q_order), key.index_select(1, order), value.index_select(1, order)
        keep = keep.index_select(0, order)
    # [whole copies | kept-channel keys]: a chunk's whole keys are written just below the kept ones, so a chunk
    # reads one slice and the kept part is never copied again
    room = head_end + min(k_len, q_chunk + recent_size + accumu_size)
    kbuf = key.new_empty(b, hkv, room + k_len, d)
    vbuf = value.new_empty(b, hkv, room + k_len, value.shape[-1])
    kbuf[:, :, room:] = key * keep.to(key.dtype).view(1, hkv, 1, d)
    vbuf[:, :, room:] = value
    out = query.new_empty(b, q_len, hq, value.shape[-1])
    zero, neg_inf = query.new_zeros(()), query.new_full((), _NEG_INF)
    for s, e, kend in _chunks(q_len, k_len, q_chunk):
        c = e - s
        p = torch.arange(kend - c, kend, device=device).view(1, c, 1)
        rf = row_recent_from(p, row, recent_size, accumu_size)  # [B, c, 1]
        band = min(max(int(rf.min()), 0), kend)
        whole = torch.arange(kend, device=device) if band <= head_end else torch.cat(
            [torch.arange(head_end, device=device), torch.arange(band, kend, device=device)])
        n = whole.numel()
        kbuf[:, :, room - n : room] = key.index_select(2, whole)
        vbuf[:, :, room - n : room] = value.index_select(2, whole)
        vis, mid = _regions(whole, p, row, sink_size, rf, None if allowed is None else allowed[:, s:e, whole])
        ok_whole = vis & ~mid  # sink and recent keys, every channel
        # a query's own key is a whole one: a query seeing none of those (padding) sees nothing at all
        sees = ok_whole.any(-1)
        for lo, hi, kept in ((0, n_keep, True), (n_keep, hkv, False)):
            if hi == lo:
                continue
            ok, stop = ok_whole, room
            if kept:  # heads keeping channels: their middle keys too, with those channels
                ok_kept = _regions(torch.arange(kend, device=device), p, row, sink_size, rf,
                                   None if allowed is None else allowed[:, s:e, :kend])[1]
                ok, stop = torch.cat([ok_whole, ok_kept], -1), room + kend
                if allowed is not None:  # a custom mask may hide a query's own key
                    sees = sees | ok_kept.any(-1)
            bias = torch.where(ok, zero, neg_inf)
            o = torch.nn.functional.scaled_dot_product_attention(
                query[:, lo * g : hi * g, s:e], kbuf[:, lo:hi, room - n : stop], vbuf[:, lo:hi, room - n : stop],
                attn_mask=bias.unsqueeze(1), scale=scaling, enable_gqa=True,
            )
            out[:, s:e, lo * g : hi * g] = o.transpose(1, 2).masked_fill(~sees.view(b, c, 1, 1), 0.0)
    if shuffled:
        out = torch.empty_like(out).index_copy_(2, q_order, out)
    return out


def _by_scores(query, key, value, keep, row_starts, sink_size, recent_size, accumu_size, scaling, softcap,
               attention_mask, q_chunk):
    """Explicit scores (soft-capping): the kept-channel product over every key up to the chunk's end, the
    full-channel products over head and band only."""
    b, hq, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    device = query.device
    q5 = gqa_view(query, hkv)
    kept_q = q5 * keep.to(query.dtype).view(1, hkv, 1, 1, d)
    zero = ~keep.any(-1).view(1, hkv, 1, 1, 1)
    row = row_starts.view(b, 1, 1)
    allowed = None if attention_mask is None else allowed_from_mask(attention_mask, k_len, q_len, device)
    head_end = min(k_len, int(row.max()) + sink_size)  # every row's sink lies below this
    outs = []
    for s, e, kend in _chunks(q_len, k_len, q_chunk):
        c = e - s
        p = torch.arange(kend - c, kend, device=device).view(1, c, 1)
        rf = row_recent_from(p, row, recent_size, accumu_size)  # [B, c, 1]
        visible, middle = _regions(torch.arange(kend, device=device), p, row, sink_size, rf,
                                   None if allowed is None else allowed[:, s:e, :kend])
        visible, middle = visible.view(b, 1, 1, c, kend), middle.view(b, 1, 1, c, kend)
        s_all = scores(kept_q[:, :, :, s:e], key[:, :, :kend], scaling, softcap)  # [B, Hkv, G, c, kend] fp32
        # keys in [head_end, band) are middle keys of every row and query of the chunk: kept channels only
        band = min(max(int(rf.min()), 0), kend)
        for lo, hi in ((0, kend),) if band <= head_end else ((0, head_end), (band, kend)):
            if hi > lo:
                full = scores(q5[:, :, :, s:e], key[:, :, lo:hi], scaling, softcap)
                s_all[..., lo:hi] = torch.where(middle[..., lo:hi], s_all[..., lo:hi], full)
        state = partial(masked(s_all, attended(visible, middle, zero)), value[:, :, :kend])
        outs.append(finish(state, query[:, :, s:e]))
    return torch.cat(outs, 1) if len(outs) != 1 else outs[0]
