"""The LeanK backend on CUDA: vLLM's Triton attention backend with the LeanK implementation.

Registered by :func:`leank_infer.vllm.register` in place of ``TRITON_ATTN`` (imported only when vLLM
selects that backend); a GPU engine picks it with ``--attention-backend TRITON_ATTN``. Everything
LeanK does is :class:`~leank_infer.vllm.backend.LeanKAttentionMixin` (pages, side store, rule); on
CUDA tensors its decode runs the Triton paged kernel (:mod:`~leank_infer.vllm.triton_paged`).
The decode walks the batch's requests in Python (host syncs per step), so CUDA graphs are refused:
the engine must run eager (``--enforce-eager``).

Unmeasured: no GPU was available while this was built. The kernel is tested on triton's CPU
interpreter; ``benchmarks/gpu_check.py`` (vllm part) runs this backend on a GPU in one command.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from ..mask import MaskError
from .backend import LeanKAttentionMixin


class LeanKTritonAttentionImpl(LeanKAttentionMixin, TritonAttentionImpl):
    """vLLM's Triton attention, or LeanK attention when the engine names a mask."""

    def check_platform(self, vllm_config: Any) -> None:
        if not vllm_config.model_config.enforce_eager:
            raise MaskError(
                "LeanK serving on CUDA needs eager mode (pass --enforce-eager / LLM(enforce_eager=True)): "
                "its decode is not CUDA-graph capturable"
            )


class LeanKTritonAttentionBackend(TritonAttentionBackend):
    """vLLM's Triton backend with the LeanK implementation (same name, ``TRITON_ATTN``, as it replaces it)."""

    @staticmethod
    def get_impl_cls() -> type[LeanKTritonAttentionImpl]:
        return LeanKTritonAttentionImpl
