"""Shared fixtures: tiny random models of every supported family, and the embedded model."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in the interpreter; set it before anything imports triton
# (importing torch does not, transformers does).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def tiny_config(family: str = "llama", **overrides):
    """A 2-layer random config with GQA (4 query heads, 2 KV heads, head_dim 16)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[family]
    if family == "mistral":
        common.setdefault("sliding_window", None)
    if family == "qwen2":
        common.setdefault("use_sliding_window", False)
    return cls(**common)


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    """A tiny random causal LM in eval mode, fp32, eager-free (default attention)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    return model.eval()


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread is faster, and robust on a CPU shared with other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct (loaded once per session)."""
    from leank_infer import load_base_model

    return load_base_model("embedded")
