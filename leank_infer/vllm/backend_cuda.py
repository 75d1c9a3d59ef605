"""The LeanK backend on CUDA: vLLM's Triton attention backend with the LeanK implementation, and vLLM's other CUDA
backends declining decoder layers while a mask is set.

Registered by :func:`leank_infer.vllm.register` in place of ``TRITON_ATTN`` (imported only when vLLM
selects that backend). Everything LeanK does is :class:`~leank_infer.vllm.backend.LeanKAttentionMixin`
(pages, rule); on CUDA tensors its page write and its decode are Triton kernels
(:mod:`~leank_infer.vllm.triton_paged`).

No flag is needed: vLLM's CUDA platform picks a decoder layer's backend as the first valid one of its priority
list (FLASH_ATTN on Ampere/Hopper, FLASHINFER on Blackwell, then TRITON_ATTN, ...), asking each backend class's
``validate_configuration``. The plugin registers, in place of each of those other backends
(:data:`~leank_infer.vllm.CUDA_DECLINING`), vLLM's own class with one more reason to be invalid: a LeanK mask is
set and the layer is a decoder layer (:func:`declining`). Without a mask they are vLLM's classes unchanged; with
one the platform's choice falls to TRITON_ATTN, and an ``--attention-backend`` naming another of them fails
vLLM's selection with that reason, one error. vLLM caches its selection per process by the layer's shapes, not
by ``additional_config``: a process that builds a plain GPU engine and then a LeanK one for the same model gets
the plain choice again, and planning the worker refuses it (:func:`~leank_infer.vllm.backend.plan_worker`);
start each engine in its own process (vLLM's default).

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

from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from . import CUDA_DECLINING, DECLINING_PREFIX
from .backend import LeanKAttentionMixin
from .settings import settings_from

LEANK_REASON = (
    "a LeanK mask is set: LeanK serves every decoder layer itself, on TRITON_ATTN (CPU_ATTN on CPUs), which vLLM "
    "then picks without a flag; leave --attention-backend out or name TRITON_ATTN"
)


class LeanKTritonAttentionImpl(LeanKAttentionMixin, TritonAttentionImpl):
    """vLLM's Triton attention, or LeanK attention when the engine names a mask."""


class LeanKTritonAttentionBackend(TritonAttentionBackend):
    """vLLM's Triton backend with the LeanK implementation (same name, ``TRITON_ATTN``, as it replaces it)."""

    @staticmethod
    def get_impl_cls() -> type[LeanKTritonAttentionImpl]:
        return LeanKTritonAttentionImpl


def mask_named() -> bool:
    """Whether the engine whose layers vLLM is building names a LeanK mask (``additional_config`` or
    ``$LEANK_MASK``): vLLM selects backends inside ``set_current_vllm_config``."""
    from vllm.config import get_current_vllm_config_or_none

    return settings_from(getattr(get_current_vllm_config_or_none(), "additional_config", None)) is not None


def declining(name: str) -> type:
    """vLLM's own backend ``name`` (the registry's default class, e.g. ``FlashAttentionBackend``), invalid for
    decoder layers while a LeanK mask is set, so that vLLM's selection passes it by (see the module docstring)."""
    original = resolve_obj_by_qualname(AttentionBackendEnum[name].value)

    class Declining(original):  # type: ignore[misc, valid-type]
        @classmethod
        def validate_configuration(cls, *args: object, **kwargs: object) -> list[str]:
            reasons = list(super().validate_configuration(*args, **kwargs))
            if kwargs.get("attn_type", AttentionType.DECODER) == AttentionType.DECODER and mask_named():
                reasons.append(LEANK_REASON)
            return reasons

    Declining.__name__ = Declining.__qualname__ = f"{DECLINING_PREFIX}_{name}"
    Declining.__module__ = __name__  # vLLM names a selected backend by module and qualname, then imports it
    Declining.__doc__ = f"vLLM's {name} backend, declining decoder layers while a LeanK mask is set."
    return Declining


def __getattr__(attr: str) -> type:
    """``MaskDeclining_<NAME>``: built on first use (importing a backend vLLM's build may lack, e.g. FLASHINFER,
    fails only when vLLM asks for it, as vLLM's own import would)."""
    prefix = DECLINING_PREFIX + "_"
    if attr.startswith(prefix) and attr[len(prefix) :] in CUDA_DECLINING:
        cls = globals()[attr] = declining(attr[len(prefix) :])
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
