"""The CUDA side of the plugin as far as a CPU machine can check it: registration, and no eager-only refusal.

The kernels themselves (decode, page write) are tested on triton's interpreter
(tests/test_vllm_triton_paged.py); a GPU run and a CUDA graph capture are benchmarks/gpu_check.py's vllm
part (unmeasured here: no GPU).
"""

from __future__ import annotations

from types import SimpleNamespace


def test_register_puts_leank_in_both_backend_slots():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from leank_infer.vllm import BACKEND, CUDA_BACKEND, register

    register()
    assert AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND
    assert AttentionBackendEnum.TRITON_ATTN.get_path() == CUDA_BACKEND
    cls = AttentionBackendEnum.TRITON_ATTN.get_class()
    from leank_infer.vllm.backend import LeanKAttentionMixin

    assert issubclass(cls.get_impl_cls(), LeanKAttentionMixin)


def test_cuda_variant_allows_cuda_graphs():
    """The decode and the write are capturable (no host sync, launches fixed by the batch shape): the CUDA
    variant no longer asks for --enforce-eager."""
    from leank_infer.vllm.backend_cuda import LeanKTritonAttentionImpl

    impl = object.__new__(LeanKTritonAttentionImpl)  # only the check: no GPU to build a real one on
    for eager in (True, False):
        impl.check_platform(SimpleNamespace(model_config=SimpleNamespace(enforce_eager=eager)))
