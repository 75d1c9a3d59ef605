"""Which decode backend runs a step: the dispatcher above the PyTorch path and the Triton kernel.

Both implement one contract, ``(query, layout, masks, scaling, softcap) -> [B, Q, Hq, D]`` (see
:mod:`leank_infer.decode.layout`); this module only chooses. ``backend``: "torch", "triton" (the kernel;
an error if triton is missing or the tensors are not on CUDA, unless the kernels run on triton's
CPU interpreter), "auto" or None (``LEANK_BACKEND``, default auto: the kernel for CUDA tensors when
triton is installed, else torch). Inputs the kernel does not cover (``q_len > 1``, other dtypes,
...) go to the PyTorch path.
"""

from __future__ import annotations

import os

import torch

from . import triton_decode
from .layout import DecodeLayout, DecodeMasks
from .torch_decode import torch_decode_attention

BACKENDS = ("torch", "triton", "auto")


class BackendError(ValueError):
    """The decode backend asked for (argument or ``LEANK_BACKEND``) is not one of :data:`BACKENDS`."""


def requested_backend(backend: str | None = None) -> str:
    """The backend asked for: the argument, else ``LEANK_BACKEND``, else "auto" (checked against BACKENDS)."""
    if backend is None:
        backend = os.environ.get("LEANK_BACKEND")
        if backend is None:
            return "auto"
        backend = backend.strip().lower() or "auto"
        if backend not in BACKENDS:
            raise BackendError(f"LEANK_BACKEND must be one of {', '.join(BACKENDS)} (or unset), got {backend!r}")
        if backend == "triton" and not triton_decode.HAS_TRITON:
            raise BackendError("LEANK_BACKEND=triton needs triton installed (pip install triton); unset it for auto")
        if backend == "triton" and not torch.cuda.is_available() and not triton_decode.kernels_interpreted():
            raise BackendError("LEANK_BACKEND=triton needs a CUDA GPU, which this machine lacks (or TRITON_INTERPRET=1 "
                               "for triton's CPU interpreter); unset it for auto")
    backend = backend.lower()
    if backend not in BACKENDS:
        raise BackendError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


def choose_backend(backend: str | None, device: torch.device, triton_available: bool) -> str:
    """"torch" or "triton" for tensors on ``device`` (the seam tests fake device and availability at)."""
    backend = requested_backend(backend)
    if backend == "auto":
        return "triton" if triton_available and torch.device(device).type == "cuda" else "torch"
    return backend


def decode_attention(
    query: torch.Tensor,
    layout: DecodeLayout,
    masks: DecodeMasks,
    scaling: float,
    softcap: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """LeanK decode attention on the chosen backend (module docstring); ``[B, Q, Hq, D]``."""
    if choose_backend(backend, query.device, triton_decode.HAS_TRITON) == "torch":
        return torch_decode_attention(query, layout, masks, scaling, softcap)
    if not triton_decode.HAS_TRITON:
        raise RuntimeError("backend='triton' needs triton installed (pip install triton)")
    if not query.is_cuda and not triton_decode.kernels_interpreted():
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors, got {query.device} (or, for triton's CPU interpreter, "
            "TRITON_INTERPRET=1 set before triton is first imported)"
        )
    if triton_decode.unsupported(query, layout, masks, softcap) is not None:
        return torch_decode_attention(query, layout, masks, scaling, softcap)
    return triton_decode.triton_decode_attention(query, layout, masks, scaling, softcap)
