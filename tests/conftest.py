"""Shared fixtures: tiny random models of every supported family, and the embedded model."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

# Without a GPU, Triton kernels run in the interpreter; set it before anything imports triton
# (importing torch does not, transformers does).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
# Families with their own quirks (tests/test_families.py): Gemma 2 soft-caps attention logits and
# alternates sliding-window and global layers, Gemma 3 (text) adds q/k norms to that, Phi-3 fuses
# qkv_proj and rotates only part of each head (partial_rotary_factor).
MORE_FAMILIES = ("gemma2", "gemma3", "phi3")


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as a module (benchmarks/ is scripts, not a package), once per name."""
    key = f"leank_benchmark_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod  # dataclasses look their module up while the class is built
        spec.loader.exec_module(mod)
    return sys.modules[key]


def documented_recent_from(position: int, recent: int, accumu: int) -> int:
    """First full recent key of a generated query at ``position`` (counted from its row's first real token),
    from docs/rule.md ("Exact boundaries") alone, not from any cache: ``recent`` keys back, rounded down to a
    multiple of ``accumu``. Tests build their reference's full/middle split from this and the token positions."""
    return (position - recent) // accumu * accumu


def tiny_config(family: str = "llama", **overrides):
    """A 2-layer random config with GQA (4 query heads, 2 KV heads, head_dim 16).

    Gemma 2/3: layer 0 is a sliding-window layer (window 16), layer 1 a global one; Gemma 2's weights
    are drawn larger (std 0.1) so that its logit soft-cap (2.0) really changes the scores.
    """
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

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
    if family in ("gemma2", "gemma3"):
        common.update(sliding_window=16, query_pre_attn_scalar=16)
        common["layer_types"] = ["sliding_attention", "full_attention"]
    if family == "gemma2":  # weights 5x the default scale: logits of a few units, where the cap bites
        common.update(attn_logit_softcapping=2.0, initializer_range=0.1)
    if family == "phi3":  # head_dim is hidden_size / heads; half of each head is rotated
        del common["head_dim"]
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    common.update(overrides)
    if family in ("gemma2", "gemma3") and "num_hidden_layers" in overrides and "layer_types" not in overrides:
        del common["layer_types"]  # let the config derive its pattern for the other layer count
    cls = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mistral": MistralConfig,
        "gemma2": Gemma2Config,
        "gemma3": Gemma3TextConfig,
        "phi3": Phi3Config,
    }[family]
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


@pytest.fixture
def fake_embedded(tmp_path, monkeypatch):
    """``_embedded_copy`` of a fake GGUF in a fresh LEANK_CACHE, the de-quantisation stood in for by a tiny model."""
    import leank_infer.model.loading as loading

    monkeypatch.setenv("LEANK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "_VERIFIED", {}, raising=False)
    gguf = tmp_path / "pkg" / "tiny.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    model = tiny_model("llama")

    class FakeAuto:
        @staticmethod
        def from_pretrained(*a, **k):
            return model

        @staticmethod
        def from_config(config, **k):
            return type(model)(config)

    class FakeTok:
        @staticmethod
        def from_pretrained(*a, **k):
            class T:
                def save_pretrained(self, folder):
                    Path(folder, "tokenizer.json").write_text("{}")
            return T()

    monkeypatch.setattr("transformers.AutoModelForCausalLM", FakeAuto)
    monkeypatch.setattr("transformers.AutoTokenizer", FakeTok)
    return lambda: loading._embedded_copy(gguf)


@pytest.fixture
def alarm():
    """Fail (instead of hanging the suite) when the test body runs longer than ``seconds``: SIGALRM interrupts
    even `re`'s C matching loop in the main thread."""
    import signal

    def expire(*_):
        raise TimeoutError("hung: still running when the alarm went off")

    old = signal.signal(signal.SIGALRM, expire)
    yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def assert_applies_as_peft_would(folder, base) -> None:
    """leank's ``apply_adapter`` of the adapter in ``folder`` gives peft's own logits on ``base`` (copies of it),
    and they differ from the base model's (the adapter changed something)."""
    import copy

    from peft import PeftModel

    from leank_infer.model.loading import apply_adapter

    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    want = PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval()(ids).logits
    got = apply_adapter(copy.deepcopy(base), folder)(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, base(ids).logits, atol=1e-3)
