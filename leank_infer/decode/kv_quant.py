"""The quantised format of the LeanK middle: KIVI's grouping over the kept channels, in 8 or 4 bits.

LeanK drops K channels; quantisation drops bits of what is left. Only the compressed middle is
quantised: the sink and the recent tokens stay in full precision, like KIVI's residual window.

- K (the kept channels only) is quantised **per channel**, a scale and a minimum for every kept channel
  and every :attr:`KVQuant.k_group` consecutive middle tokens (KIVI: K's outliers sit in fixed
  channels, and LeanK keeps exactly those, so each channel gets its own range).
- V is quantised **per token**, a scale and a minimum for every :attr:`KVQuant.v_group` channels of a
  token's row (KIVI: V has no channel outliers; its error averages out in the weighted sum).

Codes are unsigned, asymmetric: ``x ~ code * scale + minimum``, ``code`` in ``[0, 2**bits - 1]``. int4 codes
are packed two per byte **along the channels** (channel ``2i`` in the low nibble, ``2i + 1`` in the
high one; an odd count leaves the last high nibble 0), for K and V alike, so packing never straddles
tokens and the middle can grow a token at a time. Scales and minima are float16 whatever the model's
dtype (:data:`PARAM_DTYPE`), rounded outward (the minimum down, the scale up), so the grid always covers
the group and the error of every value is at most half a step: ``|x - dequant(x)| <= scale / 2``
(:func:`max_error`), plus the float rounding of the dequantisation itself.

Why by hand and not a library: torchao's ``quantize_affine`` / ``choose_qparams_affine`` compute
int-domain zero points and leave packing to layouts of its own kernels; optimum-quanto and HQQ return
tensor subclasses packed in their own layouts, built whole from one tensor. The middle needs codes it
can append to in place, in the channel-major storage the decode backends read with unit stride, and
dequantised inside those backends (the PyTorch path and the Triton kernel): none of them gives that
layout, and the arithmetic is a dozen lines. transformers' ``QuantizedCache`` (quanto/HQQ) is measured
beside it as the quantisation-alone baseline (docs/speed.md, "KV quantisation").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..mask.kv_bytes import PARAM_BYTES

#: dtype of every scale and minimum, whatever the model's dtype (:data:`PARAM_BYTES` each)
PARAM_DTYPE = torch.float16
#: the measured default group sizes (docs/speed.md, "KV quantisation": benchmarks/quant_groups.py)
K_GROUP = 32  # middle tokens per K scale (per kept channel)
V_GROUP = 64  # channels per V scale (per token); a head_dim smaller than this uses the whole row
MAX_GROUP = 1024  # a larger group buffers that many full-precision tokens per open K group (2**26 asked 8 GiB)
_F16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True)
class KVQuant:
    """A quantised-middle format: ``bits`` per value, K scales per ``k_group`` tokens (per kept channel),
    V scales per ``v_group`` channels (per token)."""

    name: str
    bits: int
    k_group: int = K_GROUP
    v_group: int = V_GROUP

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in (4, 8):
            raise ValueError(f"kv_quant bits must be 8 or 4, got {self.bits!r}")
        if self.name != f"int{self.bits}":
            raise ValueError(f"kv_quant name {self.name!r} does not match its {self.bits} bits (int{self.bits})")
        for what, g in (("k_group", self.k_group), ("v_group", self.v_group)):
            if isinstance(g, bool) or not isinstance(g, int) or g < 1 or g & (g - 1) or g > MAX_GROUP:
                raise ValueError(f"kv_quant {what} must be a power of two from 1 to {MAX_GROUP}, got {g!r}")

    @property
    def levels(self) -> int:
        """The largest code: ``2**bits - 1``."""
        return (1 << self.bits) - 1

    @property
    def per_byte(self) -> int:
        """Codes per stored byte: 1 (int8) or 2 (int4, packed along the channels)."""
        return 8 // self.bits

    def v_group_for(self, head_dim: int) -> int:
        """The V group of a model with ``head_dim`` channels: :attr:`v_group`, or the whole row if smaller."""
        g = min(self.v_group, head_dim)
        if head_dim % g:
            raise ValueError(f"kv_quant v_group {g} does not divide head_dim {head_dim}")
        return g

    def packed(self, channels: int) -> int:
        """Bytes of ``channels`` codes of one token."""
        return -(-channels // self.per_byte)


#: the formats by the name ``kv_quant=`` takes
KV_QUANTS: dict[str, KVQuant] = {"int8": KVQuant("int8", 8), "int4": KVQuant("int4", 4)}


def kv_quant_format(kv_quant: str | KVQuant | None) -> KVQuant | None:
    """The format ``kv_quant`` names (``"int8"``, ``"int4"``, a :class:`KVQuant`, or None: no quantisation)."""
    if kv_quant is None or isinstance(kv_quant, KVQuant):
        return kv_quant
    if not isinstance(kv_quant, str) or kv_quant not in KV_QUANTS:
        raise ValueError(f"kv_quant must be one of {', '.join(map(repr, KV_QUANTS))} or None, got {kv_quant!r}")
    return KV_QUANTS[kv_quant]


def quant_params(x: torch.Tensor, group: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, minimum) in :data:`PARAM_DTYPE` of every ``group`` consecutive values along ``x``'s last axis
    (its length a multiple of ``group``): ``[..., n // group]`` each, rounded outward so the grid covers
    every value. Non-finite values, or ranges beyond float16's, are an error (never a silent inf scale)."""
    g = x.float().unflatten(-1, (-1, group))
    lo, hi = g.amin(-1), g.amax(-1)
    if not (bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all())):
        raise ValueError("cannot quantise K/V holding NaN or inf values (kv_quant)")
    if bool((lo < -_F16_MAX).any()) or bool((hi > _F16_MAX).any()):
        raise ValueError(f"cannot quantise K/V beyond +/-{_F16_MAX:g}: kv_quant keeps float16 scales")
    lo16 = lo.to(PARAM_DTYPE)
    lo16 = torch.where(lo16.float() > lo, torch.nextafter(lo16, lo16.new_full((), float("-inf"))), lo16)
    step = (hi.double() - lo16.double()) / levels  # float64: float32's rounding could land a hair under the range
    step16 = step.to(PARAM_DTYPE)
    step16 = torch.where(step16.float() < step, torch.nextafter(step16, step16.new_full((), float("inf"))), step16)
    tiny = torch.finfo(PARAM_DTYPE).tiny  # a constant group: any positive scale, the codes are 0
    step16 = step16.clamp_min(tiny)
    if not bool(torch.isfinite(step16).all()):
        raise ValueError(f"cannot quantise K/V whose range exceeds {_F16_MAX:g}: kv_quant keeps float16 scales")
    return step16, lo16


def quantize(x: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int, levels: int) -> torch.Tensor:
    """uint8 codes of ``x`` (``[..., n]``) on the grid ``(scale, minimum)`` (``[..., n // group]``)."""
    g = x.float().unflatten(-1, (-1, group))
    codes = (g - minimum.float().unsqueeze(-1)).div_(scale.float().unsqueeze(-1)).round_().clamp_(0, levels)
    return codes.to(torch.uint8).flatten(-2)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scale + minimum`` (unpacked codes ``[..., n]``, params ``[..., n // group]``) in ``dtype``."""
    g = codes.to(torch.float32).unflatten(-1, (-1, group))
    out = torch.addcmul(minimum.float().unsqueeze(-1), g, scale.float().unsqueeze(-1))
    return out.flatten(-2).to(dtype)


def max_error(scale: torch.Tensor) -> torch.Tensor:
    """The format's stated error bound of a value quantised with ``scale``: half a step."""
    return scale.float() / 2


def pack(codes: torch.Tensor, dim: int, per_byte: int) -> torch.Tensor:
    """Codes packed ``per_byte`` to a byte along ``dim`` (2: nibbles, even index low; 1: unchanged)."""
    if per_byte == 1:
        return codes
    dim = dim % codes.ndim
    if codes.shape[dim] % 2:
        pad = list(codes.shape)
        pad[dim] = 1
        codes = torch.cat([codes, codes.new_zeros(pad)], dim)
    pairs = codes.unflatten(dim, (-1, 2))
    return pairs.select(dim + 1, 0) | (pairs.select(dim + 1, 1) << 4)


def unpack(packed: torch.Tensor, dim: int, per_byte: int, length: int) -> torch.Tensor:
    """The first ``length`` codes along ``dim`` of :func:`pack`'s bytes."""
    if per_byte == 1:
        return packed
    dim = dim % packed.ndim
    both = torch.stack([packed & 15, packed >> 4], dim + 1).flatten(dim, dim + 1)
    return both.narrow(dim, 0, length)


__all__ = ["K_GROUP", "KV_QUANTS", "PARAM_BYTES", "PARAM_DTYPE", "V_GROUP", "KVQuant", "dequantize", "kv_quant_format",
           "max_error", "pack", "quant_params", "quantize", "unpack"]
