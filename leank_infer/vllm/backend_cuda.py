"""The LeanK backend on CUDA: vLLM's Triton attention backend with the LeanK implementation.

Registered by :func:`leank_infer.vllm.register` in place of ``TRITON_ATTN`` (imported only when vLLM
selects that backend); a GPU engine picks it with ``--attention-backend TRITON_ATTN``. Everything
LeanK does is :class:`~leank_infer.vllm.backend.LeanKAttentionMixin` (pages, rule); on CUDA tensors
its page write and its decode are Triton kernels (:mod:`~leank_infer.vllm.triton_paged`).

CUDA graphs: the LeanK metadata builders declare ``UNIFORM_SINGLE_TOKEN_DECODE``
(:mod:`~leank_infer.vllm.stores`), so with vLLM's default ``FULL_AND_PIECEWISE`` a step of decodes
only replays a full graph (the write and the decode captured inside it) and a step with a prefill
runs attention eagerly between piecewise graphs. What a full decode graph needs holds in the code:
the write and the decode launch a fixed set of kernels whose grids and arguments depend on the
batch's shape only, read ``seq_lens``, block tables and slot mappings on the device (vLLM's
persistent buffers, padded with 0 lengths, the null block and slot -1, which the kernels skip), copy
nothing from the host (the channel tables go to the GPU when the worker is planned) and never sync.
The interpreter tests check the fixed launches and the absence of host reads
(``tests/test_vllm_triton_paged.py``).

Unmeasured: no GPU was available while this was built. Neither a vLLM engine on CUDA nor its graph
capture has run; ``benchmarks/gpu_check.py`` (vllm part) captures and replays one decode step of a
LeanK layer (write + decode) in a CUDA graph against eager results, and runs the engine when vLLM is
installed.
"""

from __future__ import annotations

from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from .backend import LeanKAttentionMixin


class LeanKTritonAttentionImpl(LeanKAttentionMixin, TritonAttentionImpl):
    """vLLM's Triton attention, or LeanK attention when the engine names a mask."""


class LeanKTritonAttentionBackend(TritonAttentionBackend):
    """vLLM's Triton backend with the LeanK implementation (same name, ``TRITON_ATTN``, as it replaces it)."""

    @staticmethod
    def get_impl_cls() -> type[LeanKTritonAttentionImpl]:
        return LeanKTritonAttentionImpl
