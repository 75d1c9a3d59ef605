"""The CUDA side of the plugin as far as a CPU machine can check it: registration, the backend vLLM's CUDA
platform selects with and without a mask (no flag needed), and no eager-only refusal.

The kernels themselves (decode, page write) are tested on triton's interpreter
(tests/test_vllm_triton_paged.py); a GPU run and a CUDA graph capture are benchmarks/gpu_check.py's vllm
part (unmeasured here: no GPU).
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from .conftest import MASK


def test_register_puts_leank_in_both_backend_slots_and_declining_classes_in_the_others():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from leank_infer.vllm import BACKEND, CUDA_BACKEND, CUDA_DECLINING, register

    register()
    assert AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND
    assert AttentionBackendEnum.TRITON_ATTN.get_path() == CUDA_BACKEND
    for name in CUDA_DECLINING:
        member = AttentionBackendEnum[name]
        try:
            original = resolve_obj_by_qualname(member.value)
        except ImportError:  # not in this build (FLASHINFER): the declining class fails the same way
            with pytest.raises(ImportError):
                member.get_class()
            continue
        cls = member.get_class()
        assert cls.__mro__[1] is original and cls.get_name() == original.get_name(), name
        assert member.get_path() == f"{cls.__module__}.{cls.__qualname__}"  # how vLLM names a selected class
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


# ---- the backend vLLM's CUDA platform picks, driven on the CPU build by a stand-in ----------------------------
# vllm.platforms.cuda imports the CUDA build's compiled ops (vllm._C_stable_libtorch) at import: a stand-in
# module lets the CPU build import it; a subclass of its platform gives the device capability. The selection
# itself (priority lists, each backend class's validate_configuration, the registry's overrides) is vLLM's.
CAPABILITIES = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]


@pytest.fixture(scope="module")
def cuda_platform():
    import sys
    import types

    stub = "vllm._C_stable_libtorch"
    added = stub not in sys.modules
    if added:
        sys.modules[stub] = types.ModuleType(stub)
    try:
        from vllm.platforms import cuda
    finally:
        if added:
            del sys.modules[stub]
    from vllm.platforms.interface import DeviceCapability

    def platform(capability):
        class StandIn(cuda.CudaPlatformBase):
            @classmethod
            def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
                return DeviceCapability(*capability)

        return StandIn

    return cuda, platform


def selector(attn_type: str = "decoder", **changes):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None,
                                   attn_type=attn_type, **changes)  # fmt: skip


@contextmanager
def engine(mask: str | None):
    """The config vLLM selects backends under (as while it builds a model's layers), naming a mask or not."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(additional_config={"leank_mask": mask} if mask else {})):
        yield


def test_the_declining_backends_are_every_other_backend_of_vllms_cuda_priority_lists(cuda_platform):
    """If vLLM adds a decoder backend to its CUDA priorities, this fails until the plugin declines it too."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from leank_infer.vllm import CUDA_DECLINING

    cuda, _ = cuda_platform
    seen = set()
    for cap in CAPABILITIES:
        for mm_prefix in (False, True):
            for non_causal in (False, True):
                seen |= set(cuda._get_backend_priorities(False, DeviceCapability(*cap), use_non_causal=non_causal,
                                                         head_size=64, use_mm_prefix=mm_prefix))  # fmt: skip
    assert {b.name for b in seen} - {AttentionBackendEnum.TRITON_ATTN.name} == set(CUDA_DECLINING)


def test_without_a_mask_vllm_picks_its_own_backend_and_with_one_leanks(cuda_platform, monkeypatch):
    """On every capability: no mask, the platform picks what it picks without the plugin (vLLM's class, under
    the declining name); a mask, TRITON_ATTN, LeanK's, for decoder layers only (an encoder layer keeps vLLM's)."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from leank_infer.vllm import CUDA_BACKEND, CUDA_DECLINING, register
    from leank_infer.vllm.backend import LeanKAttentionMixin

    monkeypatch.delenv("LEANK_MASK", raising=False)
    _, platform = cuda_platform
    for name in ("TRITON_ATTN", *CUDA_DECLINING):
        AttentionBackendEnum[name].clear_override()
    vllm_alone = {cap: platform(cap).get_attn_backend_cls(None, selector()) for cap in CAPABILITIES}
    encoder_alone = platform((9, 0)).get_attn_backend_cls(None, selector("encoder_only"))
    register()
    picked = set()
    for cap in CAPABILITIES:
        with engine(None):
            plain = resolve_obj_by_qualname(platform(cap).get_attn_backend_cls(None, selector()))
        assert plain.__mro__[1] is resolve_obj_by_qualname(vllm_alone[cap]), (cap, plain, vllm_alone[cap])
        picked.add(plain.get_name())
        with engine(MASK):
            assert platform(cap).get_attn_backend_cls(None, selector()) == CUDA_BACKEND, cap
            enc = resolve_obj_by_qualname(platform(cap).get_attn_backend_cls(None, selector("encoder_only")))
        if cap == (9, 0):
            assert enc.__mro__[1] is resolve_obj_by_qualname(encoder_alone)
    assert "FLASH_ATTN" in picked  # vLLM's first choice here (FLASHINFER is not in the CPU build)
    assert issubclass(resolve_obj_by_qualname(CUDA_BACKEND).get_impl_cls(), LeanKAttentionMixin)


def test_attention_backend_flag_is_an_override_refused_with_one_error_when_leank_cannot_run_it(cuda_platform, monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from leank_infer.vllm import CUDA_BACKEND, register
    from leank_infer.vllm.backend_cuda import LEANK_REASON

    monkeypatch.delenv("LEANK_MASK", raising=False)
    _, platform = cuda_platform
    register()
    hopper = platform((9, 0))
    for name in ("FLASH_ATTN", "FLEX_ATTENTION"):
        with engine(MASK), pytest.raises(ValueError) as e:
            hopper.get_attn_backend_cls(AttentionBackendEnum[name], selector())
        assert f"Selected backend AttentionBackendEnum.{name} is not valid" in str(e.value)
        assert str(e.value).count(LEANK_REASON) == 1
        with engine(None):  # without a mask the flag is vLLM's as ever
            assert hopper.get_attn_backend_cls(AttentionBackendEnum[name], selector()).endswith(f"_{name}")
    with engine(MASK):
        assert hopper.get_attn_backend_cls(AttentionBackendEnum.TRITON_ATTN, selector()) == CUDA_BACKEND
    monkeypatch.setenv("LEANK_MASK", MASK)  # the mask named by the environment counts the same
    with engine(None):
        assert hopper.get_attn_backend_cls(None, selector()) == CUDA_BACKEND


@pytest.mark.slow
def test_gpu_checks_engine_at_cpu_size_gives_every_layer_to_leank_without_a_flag(tmp_path):
    """benchmarks/gpu_check.py's engine run (its own process, started with no attention-backend argument) on
    vLLM's CPU build at CPU size: every decoder layer is LeanK's and the step timing comes back. On a GPU the
    same code runs the 8B shape (unmeasured here)."""
    from conftest import load_benchmark  # tests/conftest.py

    gpu_check = load_benchmark("gpu_check")
    model, mask = tmp_path / "model", tmp_path / "mask"
    gpu_check.llama_config(True).save_pretrained(model)
    gpu_check._vllm_mask(True).save_pretrained(mask)
    out = gpu_check.run_engine(str(model), str(mask), True, timeout=600)
    assert out["impls"] == ["LeanKCPUAttentionImpl"] and out["leank_layers"] == out["layers"] == 2, out
    assert out["kv_cache_tokens"] > 0 and out["running"] >= 1 and out["tok_s"] > 0, out
