"""leank's vLLM plugin: serve a model with a LeanK mask, holding more tokens in the same KV memory.

Installed with ``pip install 'leank[vllm]'``; vLLM finds :func:`register` through the
``vllm.general_plugins`` entry point in every process it starts. A mask is named with vLLM's own
plugin setting, ``additional_config`` (see :mod:`leank_infer.vllm.settings`)::

    vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --additional-config '{"leank_mask": "org/mask-repo"}' \
        --no-enable-prefix-caching --no-enable-chunked-prefill

    LLM(model=..., additional_config={"leank_mask": "hub/smollm2-135m-instruct"},
        enable_prefix_caching=False, enable_chunked_prefill=False)

Nothing in ``leank_infer`` imports this package: only vLLM (through the entry point) or a user does.
"""

from __future__ import annotations

BACKEND = "leank_infer.vllm.backend.LeanKCPUAttentionBackend"
CUDA_BACKEND = "leank_infer.vllm.backend_cuda.LeanKTritonAttentionBackend"


def register() -> None:
    """vLLM general plugin: put the LeanK backends in place of vLLM's CPU and Triton attention backends.

    ``register_backend`` takes a class path (the backend is imported when vLLM builds its first
    attention layer); the backend acts only when the engine's ``additional_config`` (or
    ``$LEANK_MASK``) names a mask, and is vLLM's own CPU attention otherwise. Also installs the
    per-layer page hook (:mod:`leank_infer.vllm.spec`). Safe to call more than once.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .spec import install

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    register_backend(AttentionBackendEnum.TRITON_ATTN, CUDA_BACKEND)  # GPUs: --attention-backend TRITON_ATTN
    install()
