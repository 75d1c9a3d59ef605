"""The PyTorch decode backend: attention of new queries over a :class:`~leank_infer.decode.layout.DecodeLayout`.

Contract (shared with :func:`leank_infer.decode.triton_decode.triton_decode_attention`):
``(query [B, Hq, Q, D], layout, masks, scaling, softcap) -> [B, Q, Hq, D]``, equal to the LeanK rule
over the full K/V. Every part (the full-channel head + tail, each kept-count group of the middle)
gives an unnormalised partial and the parts merge by log-sum-exp, as in flash-decoding.

Two paths compute the same thing:

- fast (one query per row, trivial masks, fp32 on CPU, no soft-cap): one matmul for the head +
  tail scores, one gather of q and one matmul per kept-count group for the middle scores, one
  softmax over both, two products with V: about ten ops per layer, no reduction statistics to merge;
- general (left padding, several queries, model masks, soft-cap, half precision, CUDA): explicit
  scores with the region masks, fp32 softmax statistics.

A quantised middle (kv_quant, :mod:`leank_infer.decode.kv_quant`) is read by the fast path's own variant
(:func:`_fast_quantised`: the CPU kernel of :mod:`leank_infer.decode.quant_cpu` where it is built, else int4
nibbles as two half-width PyTorch products, never unpacked), or dequantised first.
"""

from __future__ import annotations

import torch

from . import quant_cpu
from .layout import DecodeLayout, DecodeMasks
from .rule import apply_softcap, gqa_view

_NEG_INF = float("-inf")
_FLOOR = -1e30  # finite floor of running maxima: exp(-inf - floor) = 0, exp(floor - floor) = 1


def torch_decode_attention(
    query: torch.Tensor,
    layout: DecodeLayout,
    masks: DecodeMasks,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """LeanK attention of ``query`` (``[B, Hq, Q, D]``, post-RoPE) over ``layout``; ``[B, Q, Hq, D]``.

    A quantised middle (``layout.quant``, kv_quant) is dequantised here, its int8/int4 codes times their
    group's scale plus its minimum, in the dtype of the full part; the step then runs as over any middle."""
    if layout.quant is not None:
        dv = layout.full_v.shape[-1]
        if fast_path_applies(query, layout, masks, softcap) and layout.quant.v_group == dv \
                and (layout.quant.fmt.per_byte == 1 or dv % 2 == 0):
            return _fast_quantised(query, layout, scaling)
        layout = layout.dequantized()
    if fast_path_applies(query, layout, masks, softcap):
        return _fast(query, layout, scaling)
    return _general(query, layout, masks, scaling, softcap)


def fast_path_applies(query: torch.Tensor, layout: DecodeLayout, masks: DecodeMasks, softcap: float | None) -> bool:
    """Whether :func:`torch_decode_attention` takes its fused path for these inputs."""
    return (
        masks.trivial
        and softcap is None
        and query.shape[2] == 1
        and query.device.type == "cpu"
        and query.dtype == torch.float32
        and layout.full_k.shape[2] > 0
        and layout.full_v.shape[-1] == query.shape[-1]
    )


def _fast(query: torch.Tensor, layout: DecodeLayout, scaling: float) -> torch.Tensor:
    """One softmax over [full scores | middle scores] per head, then the products with V; groups and
    middle V are in KV-head order (:class:`~leank_infer.decode.layout.ChannelGroups`), so no index shuffles.
    Products are 3-D ``bmm`` on views of the cache's storage (no copies of K or V); the scale rides
    on them (``alpha``)."""
    b, hq, _, d = query.shape
    groups = layout.groups
    hkv = groups.num_kv_heads
    g = hq // hkv
    full = layout.full_k.shape[2]
    kt = layout.full_k.reshape(b * hkv, full, d).transpose(1, 2)
    s_full = torch.baddbmm(_ZERO, query.reshape(b * hkv, g, d), kt, beta=0, alpha=scaling)  # [B*Hkv, G, F]
    n = layout.mid_len
    dv = layout.full_v.shape[-1]
    full_v = layout.full_v.reshape(b * hkv, full, dv)
    if n == 0 or not groups.counts:
        return torch.bmm(s_full.softmax(-1), full_v).view(b, 1, hq, dv)
    q_sel = query.reshape(b, hq * d).index_select(1, groups.query_index(g, d))
    blocks = []
    for gi, hg, c, off in groups.score_plan(g):
        if gi < 0:  # zero-channel heads: no middle key
            blocks.append(_NEG_INF_T.expand(b, hg, g, n))
            continue
        qg = q_sel[:, off : off + hg * g * c].reshape(b * hg, g, c)
        kg = layout.mid_k[gi].reshape(b * hg, n, c).transpose(1, 2)
        blocks.append(torch.baddbmm(_ZERO, qg, kg, beta=0, alpha=scaling).view(b, hg, g, n))
    s_mid = blocks[0] if len(blocks) == 1 else torch.cat(blocks, 1)  # [B, Hkv, G, n]
    p = torch.cat([s_full.view(b, hkv, g, full), s_mid], -1).softmax(-1).view(b * hkv, g, full + n)
    out = torch.bmm(p[:, :, :full], full_v)  # [B * Hkv, G, Dv]
    mid_v = layout.mid_v
    for first, end, v_off in groups.runs():
        if v_off is None:
            continue
        h = end - first
        if h == hkv:  # every head keeps channels: one fused product-and-add
            out = torch.baddbmm(out, p[:, :, full:], mid_v.reshape(b * h, n, dv))
        else:
            p4 = p.view(b, hkv, g, full + n)[:, first:end, :, full:]
            out.view(b, hkv, g, dv)[:, first:end] += torch.matmul(p4, mid_v[:, v_off : v_off + h])
    return out.view(b, 1, hq, dv)


def _fast_quantised(query: torch.Tensor, layout: DecodeLayout, scaling: float) -> torch.Tensor:
    """:func:`_fast` over a quantised middle (V: one scale per token and head): the products that read the codes
    run in the CPU kernel (:mod:`~leank_infer.decode.quant_cpu`, codes read as bytes) where it is available, else
    in PyTorch (:func:`_k_scores_torch`, :func:`_v_torch`: each code converted to fp32 once). The full-precision
    part and the softmax are the same for both."""
    b, hq, _, d = query.shape
    groups, quant = layout.groups, layout.quant
    hkv = groups.num_kv_heads
    g = hq // hkv
    full = layout.full_k.shape[2]
    kt = layout.full_k.reshape(b * hkv, full, d).transpose(1, 2)
    s_full = torch.baddbmm(_ZERO, query.reshape(b * hkv, g, d), kt, beta=0, alpha=scaling)
    n = layout.mid_len
    dv = layout.full_v.shape[-1]
    full_v = layout.full_v.reshape(b * hkv, full, dv)
    if n == 0 or not groups.counts:
        return torch.bmm(s_full.softmax(-1), full_v).view(b, 1, hq, dv)
    kernel = quant_cpu.available() and quant_cpu.supports(
        layout.mid_k, quant.k_scale, quant.k_min, layout.mid_v, quant.v_scale, quant.v_min
    )
    q_sel = query.reshape(b, hq * d).index_select(1, groups.query_index(g, d))
    s = torch.empty(b, hkv, g, full + n)  # [full scores | middle scores], one softmax over both
    s[..., :full] = s_full.view(b, hkv, g, full)
    first = 0
    for gi, hg, c, off in groups.score_plan(g):
        dst = s[:, first : first + hg, :, full:]
        first += hg
        if gi < 0:  # zero-channel heads: no middle key
            dst.fill_(_NEG_INF)
            continue
        qg = q_sel[:, off : off + hg * g * c].view(b, hg, g, c)
        if kernel:
            quant_cpu.k_scores(qg, layout.mid_k[gi], quant.k_scale[gi], quant.k_min[gi], quant.phase, quant.fmt,
                               scaling, dst)
        else:
            dst.copy_(_k_scores_torch(qg, layout, gi, scaling))
    p = s.softmax(-1)
    out = torch.bmm(p.view(b * hkv, g, full + n)[:, :, :full], full_v).view(b, hkv, g, dv)
    if kernel:
        quant_cpu.v_add(p[..., full:], layout.mid_v, quant.v_scale, quant.v_min, groups.v_rows(), quant.fmt, out)
    else:
        _v_torch(p[..., full:], layout, out)
    return out.view(b, 1, hq, dv)


def _k_scores_torch(qg: torch.Tensor, layout: DecodeLayout, gi: int, scaling: float) -> torch.Tensor:
    """Head group ``gi``'s middle scores ``[B, Hg, G, n]`` for its kept query channels ``qg`` ``[B, Hg, G, c]``.

    ``q . (code * scale + min) = (q * scale) . code + q . min``: the codes times their channel's scale is the only
    pass over them (uint8 times fp32 gives fp32), the minima's part is one small product per K group; int4 as two
    half-width products (even channels in the low nibbles, odd ones in the high), never interleaved."""
    b, hg, g, c = qg.shape
    quant = layout.quant
    qg = qg.reshape(b * hg, g, c)
    kg, phase, per_byte, n = quant.fmt.k_group, quant.phase, quant.fmt.per_byte, layout.mid_len
    scale, mn = quant.k_scale[gi], quant.k_min[gi]  # [B, Hg, c, groups]
    ng = scale.shape[3]
    cm = layout.mid_k[gi].transpose(2, 3)  # [B, Hg, cp, n] codes, unit stride along the tokens
    cm = cm.as_strided((*cm.shape[:3], ng * kg), cm.stride(), cm.storage_offset() - phase * cm.stride(3))
    w = ng * kg  # from the first group's first slot
    if per_byte == 1:
        k = (cm.unflatten(3, (ng, kg)) * scale.float().unsqueeze(-1)).view(b * hg, c, w)
        sc = torch.baddbmm(_ZERO, qg, k, beta=0, alpha=scaling)
    else:
        sf = scale.float().unsqueeze(-1)
        lo, hi = cm & 15, (cm >> 4)[:, :, : c // 2]
        k_lo = (lo.unflatten(3, (ng, kg)) * sf[:, :, 0::2]).view(b * hg, -1, w)
        k_hi = (hi.unflatten(3, (ng, kg)) * sf[:, :, 1::2]).view(b * hg, -1, w)
        sc = torch.baddbmm(_ZERO, qg[..., 0::2], k_lo, beta=0, alpha=scaling)
        sc = torch.baddbmm(sc, qg[..., 1::2], k_hi, alpha=scaling)
    sc = sc.view(b * hg, g, ng, kg)
    sc += torch.bmm(qg, mn.float().reshape(b * hg, c, ng)).mul_(scaling).unsqueeze(-1)
    return sc.view(b, hg, g, ng * kg)[..., phase : phase + n]


def _v_torch(p: torch.Tensor, layout: DecodeLayout, out: torch.Tensor) -> None:
    """``out`` ``[B, Hkv, G, Dv]`` += the middle's part for weights ``p`` ``[B, Hkv, G, n]``, in place.

    ``sum_j p_j (code_j * s_j + m_j) = (p * s) @ codes + p @ m``: the conversion of the codes is the only pass."""
    quant, dv = layout.quant, out.shape[-1]
    if quant.fmt.per_byte == 1:
        codes_v: tuple[torch.Tensor, ...] = (layout.mid_v.to(torch.float32),)  # [B, Hnz, n, Dv]
    else:  # int4: even channels (low nibbles) and odd ones apart, the small outputs interleaved after
        codes_v = ((layout.mid_v & 15).to(torch.float32), (layout.mid_v >> 4)[..., : dv // 2].to(torch.float32))
    v_scale = quant.v_scale.float().squeeze(-1).unsqueeze(2)  # [B, Hnz, 1, n]
    v_min = quant.v_min.float()  # [B, Hnz, n, 1]
    for first, end, v_off in layout.groups.runs():
        if v_off is None:
            continue
        h = end - first
        pm = p[:, first:end]  # [B, h, G, n]
        part = slice(v_off, v_off + h)
        ps = pm * v_scale[:, part]
        parts = [torch.matmul(ps, cv[:, part]) for cv in codes_v]
        pv = parts[0] if len(parts) == 1 else torch.stack(parts, -1).flatten(-2)
        out[:, first:end] += pv + torch.matmul(pm, v_min[:, part])


_ZERO = torch.zeros(())  # baddbmm's ignored input (beta=0): the scale is its alpha
_NEG_INF_T = torch.tensor(float("-inf"))


# ---- general path ---------------------------------------------------------------------------------
def scores(q: torch.Tensor, k: torch.Tensor, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """fp32 logits ``[B,h,G,Q,n]`` of queries ``[B,h,G,Q,c]`` against keys ``[B,h,n,c]`` (read in place),
    scaled, then soft-capped as transformers' eager attention does (Gemma 2)."""
    b, h, g, q_len, c = q.shape
    s = torch.matmul(q.reshape(b, h, g * q_len, c), k.transpose(-1, -2))
    s = s.float() if s.dtype != torch.float32 else s
    return apply_softcap(s.view(b, h, g, q_len, -1).mul_(scaling), softcap)


def partial(s: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum_j e^(s_j - m) v_j, m, sum_j e^(s_j - m)) over the last axis of fp32 ``s`` [B,h,G,Q,k]; v: [B,h,k,D].

    m is floored at a finite value, so a fully masked part gives l = 0 and merges with weight 0.
    """
    b, h, g, q, k = s.shape
    m = s.amax(-1, keepdim=True).clamp_min_(_FLOOR)
    p = s.sub_(m).exp_()
    # one [G*Q, k] x [k, D] product per (row, head): no broadcast, so V is never copied
    acc = torch.matmul(p.to(value.dtype).view(b, h, g * q, k), value).float().view(b, h, g, q, -1)
    return acc, m, p.sum(-1, keepdim=True)


def _merge(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Log-sum-exp merge of two partial results."""
    m = torch.maximum(a[1], b[1])
    wa, wb = (a[1] - m).exp_(), (b[1] - m).exp_()
    return a[0] * wa + b[0] * wb, m, a[2] * wa + b[2] * wb


def masked(s: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    return s if allowed is None else s.masked_fill_(~allowed, _NEG_INF)


def finish(state: tuple[torch.Tensor, ...], query: torch.Tensor) -> torch.Tensor:
    """Normalise a merged partial ``[B, Hkv, G, Q, D]`` into the HF layout ``[B, Q, Hq, D]``."""
    acc, _, denom = state
    b, hq, q_len, _ = query.shape
    out = acc.div_(denom.clamp_min_(torch.finfo(torch.float32).tiny))  # l = 0 only where acc = 0
    return out.view(b, hq, q_len, -1).transpose(1, 2).to(query.dtype).contiguous()


def _general(
    query: torch.Tensor, layout: DecodeLayout, masks: DecodeMasks, scaling: float, softcap: float | None
) -> torch.Tensor:
    b, hq, q_len, d = query.shape
    groups = layout.groups
    hkv = groups.num_kv_heads
    g = hq // hkv
    q5 = gqa_view(query, hkv)
    h, t = layout.head_len, layout.tail_len

    def rows(m: torch.Tensor | None, n: int) -> torch.Tensor:  # [B or 1, Q, n] -> [B, 1, 1, Q, n]
        if m is None:
            return torch.ones(b, 1, 1, q_len, n, dtype=torch.bool, device=query.device)
        return m.expand(b, q_len, n).view(b, 1, 1, q_len, n)

    if h + t > 0:
        s = scores(q5, layout.full_k, scaling, softcap)  # [B, Hkv, G, Q, h + t]
        allowed = None
        if not masks.trivial:
            keep = groups.keep.to(query.dtype).view(1, hkv, 1, 1, d)
            nonzero = groups.nonzero.view(1, hkv, 1, 1, 1)

            def kept_channels(full: torch.Tensor, mid_mask: torch.Tensor | None, at: slice, k: torch.Tensor) -> torch.Tensor:
                """Where ``mid_mask`` says so, the region's scores with the kept channels only (zero heads: dropped)."""
                if mid_mask is None or not bool(mid_mask.any()):
                    return full
                mid = rows(mid_mask, k.shape[2])
                s[..., at] = torch.where(mid, scores(q5 * keep, k, scaling, softcap), s[..., at])
                return full | (mid & nonzero)

            # rows with left padding: their later head keys are middle keys (kept channels only); under the
            # positional rule, so can be a row's or a later query's oldest tail keys
            head = kept_channels(rows(masks.head_full, h), masks.head_mid, slice(0, h), layout.head_k)
            tail = kept_channels(rows(masks.tail, t), masks.tail_mid, slice(h, h + t), layout.tail_k)
            allowed = torch.cat([head.expand(b, hkv, 1, q_len, h), tail.expand(b, hkv, 1, q_len, t)], -1)
        state = partial(masked(s, allowed), layout.full_v)
    else:  # nothing but (possibly) middle keys: start from an empty part
        shape = (b, hkv, g, q_len, 1)
        state = (
            query.new_zeros(b, hkv, g, q_len, d, dtype=torch.float32),
            query.new_full(shape, _FLOOR, dtype=torch.float32),
            query.new_zeros(shape, dtype=torch.float32),
        )

    if layout.mid_len > 0 and groups.counts:
        allowed = None if masks.mid is None else rows(masks.mid, layout.mid_len)
        parts = []
        for heads, channels, off, k in zip(groups.heads, groups.channels, groups.v_offsets, layout.mid_k, strict=True):
            hg, c = channels.shape
            qg = q5.index_select(1, heads)
            qg = qg.gather(-1, channels.view(1, hg, 1, 1, c).expand(b, hg, g, q_len, c))
            parts.append(partial(masked(scores(qg, k, scaling, softcap), allowed), layout.mid_v[:, off : off + hg]))
        order = groups.nonzero_order
        # back to KV-head order; heads without a middle part get an empty one (m = floor, l = 0)
        fill = (0.0, _FLOOR, 0.0)
        mid_state = tuple(
            x.new_full(x.shape, f).index_copy_(1, order, torch.cat([p[i] for p in parts], 1))
            for i, (x, f) in enumerate(zip(state, fill, strict=True))
        )
        state = _merge(state, mid_state)
    return finish(state, query)
