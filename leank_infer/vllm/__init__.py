"""leank's vLLM plugin: serve a model with a LeanK mask, holding more tokens in the same KV memory.

Installed with ``pip install 'leank[vllm]'``; vLLM finds :func:`register` through the
``vllm.general_plugins`` entry point in every process it starts. A mask is named with vLLM's own
plugin setting, ``additional_config`` (see :mod:`leank_infer.vllm.settings`)::

    vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --additional-config '{"leank_mask": "org/mask-repo"}'

    LLM(model=..., additional_config={"leank_mask": "hub/smollm2-135m-instruct-s3"})

Everything else stays vLLM's: prefix caching, chunked prefill, the KV pool and its report,
preemption, tensor parallelism, fp8 KV (see :mod:`leank_infer.vllm.backend`).

Nothing in ``leank_infer`` imports this package: only vLLM (through the entry point) or a user does.
"""

from __future__ import annotations

BACKEND = "leank_infer.vllm.backend.LeanKCPUAttentionBackend"
CUDA_BACKEND = "leank_infer.vllm.backend_cuda.LeanKTritonAttentionBackend"


def register() -> None:
    """vLLM general plugin: put the LeanK backends in place of vLLM's CPU and Triton attention backends,
    and register the KV cache spec of LeanK's window pages (:mod:`leank_infer.vllm.kv_specs`).

    ``register_backend`` takes a class path (the backend is imported when vLLM builds its first
    attention layer); the backend acts only when the engine's ``additional_config`` (or
    ``$LEANK_MASK``) names a mask, and is vLLM's own attention otherwise. vLLM calls this in every
    process it starts (the scheduler needs the spec's manager). Safe to call more than once.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .kv_specs import register as register_spec

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    register_backend(AttentionBackendEnum.TRITON_ATTN, CUDA_BACKEND)  # GPUs: --attention-backend TRITON_ATTN
    register_spec()
