"""LeanK through every transformers entry point, never silently dense.

``LeanKModel.generate``, ``model.generate``, ``pipeline("text-generation")``, a generation config
saved and reloaded, a second turn on a returned cache, assisted and prompt-lookup decoding: each
decodes over a LeanK cache, checked by the bytes the cache really held afterwards (the mask's
layout formula, below what a dense cache of the same tokens holds), or stops with one
``LeanKCacheError`` that says how to get LeanK. Runs on the lowest and the newest supported
transformers (``make test-lowest``), on either side of the ``past_key_values`` -> ``cache`` rename.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_model import dense_two_turns, full_mask, hf_generate, prompt, random_mask, tiny_repo
from transformers import DynamicCache, GenerationConfig, pipeline

from leank_infer import LeanKModel
from leank_infer.decode.cache import LeanKCache, dynamic_cache_bytes
from leank_infer.model.generation import CACHE_KWARG, LeanKCacheError

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)


@pytest.fixture
def built_caches(monkeypatch) -> list[LeanKCache]:
    """Every LeanKCache made while the test runs (generate builds its own: this is how a test sees it)."""
    made: list[LeanKCache] = []
    init = LeanKCache.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(LeanKCache, "__init__", recording_init)
    return made


def assert_held_leank(cache, mask, total: int) -> None:
    """The cache is a LeanK cache over ``total`` tokens whose real storage is the pruned layout."""
    assert isinstance(cache, LeanKCache), type(cache)
    regions = cache.region_lengths()
    assert regions["total"] == total and regions["middle"] > 0, regions
    per = mask.kv_bytes_per_token(torch.float32)
    held = cache.nbytes()
    assert held == (regions["head"] + regions["tail"]) * per["dense"] + regions["middle"] * per["leank_middle"]
    assert held < total * per["dense"]  # what a dense cache of the same tokens holds


def generated_cache(out):
    """The cache a ``return_dict_in_generate=True`` output returns (``cache`` or ``past_key_values``)."""
    return getattr(out, CACHE_KWARG)


def test_model_generate_decodes_with_leank(built_caches):
    """``m.model.generate`` (no cache passed) builds a LeanK cache: pruned bytes, and dense tokens for a full mask."""
    ids = prompt(40)
    model = tiny_model("llama")
    dense_cache = DynamicCache(config=model.config)
    want = hf_generate(model, ids, cache=dense_cache, **GREEDY)
    LeanKModel(model, full_mask())
    assert torch.equal(hf_generate(model, ids, **GREEDY), want)
    assert isinstance(built_caches[-1], LeanKCache) and built_caches[-1].region_lengths()["middle"] > 0

    mask = random_mask(ratio=0.6)
    lk = LeanKModel(tiny_model("llama"), mask)
    out = lk.model.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True, **GREEDY)
    cache = generated_cache(out)
    assert cache is built_caches[-1]
    assert_held_leank(cache, mask, 40 + 16 - 1)
    assert cache.nbytes() < dynamic_cache_bytes(dense_cache) == 55 * mask.kv_bytes_per_token(torch.float32)["dense"]
    assert torch.equal(lk.generate(ids, attention_mask=torch.ones_like(ids), **GREEDY), out.sequences)


def test_pipeline_decodes_with_leank(tmp_path, built_caches):
    """The quick start's pipeline recipe (docs/quickstart.md): ``pipeline("text-generation", model=m.model, tokenizer=m.tokenizer)``."""
    mask_dir, _ = tiny_repo(tmp_path, mask=random_mask(ratio=0.6))
    m = LeanKModel.from_pretrained(mask_dir)
    pipe = pipeline("text-generation", model=m.model, tokenizer=m.tokenizer)
    text = " ".join(f"w{3 + (7 * i) % 120}" for i in range(40))
    got = pipe(text, return_full_text=False, **GREEDY)[0]["generated_text"]
    (cache,) = built_caches
    enc = m.tokenizer(text, return_tensors="pt")
    n = enc["input_ids"].shape[1]
    assert_held_leank(cache, m.mask, n + 16 - 1)
    want = m.generate(**enc, **GREEDY)[0, n:]
    assert got.strip() == m.tokenizer.decode(want, skip_special_tokens=True).strip()

    messages = [{"role": "user", "content": text}]  # chat input, as in the quick start
    reply = pipe(messages, **GREEDY)[0]["generated_text"][-1]
    assert reply["role"] == "assistant" and reply["content"].strip()
    chat = m.tokenizer(m.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    assert_held_leank(built_caches[-1], m.mask, len(chat["input_ids"]) + 16 - 1)


def test_generation_config_saved_and_reloaded(tmp_path, built_caches):
    """A reloaded generation config decodes with LeanK; one that names a dense cache_implementation is refused."""
    mask = random_mask(ratio=0.6)
    lk = LeanKModel(tiny_model("llama"), mask)
    ids = prompt(40, seed=3)
    lk.model.generation_config.save_pretrained(tmp_path / "plain")
    config = GenerationConfig.from_pretrained(tmp_path / "plain", **GREEDY)
    out = lk.model.generate(
        ids, attention_mask=torch.ones_like(ids), generation_config=config, return_dict_in_generate=True
    )
    assert_held_leank(generated_cache(out), mask, 40 + 16 - 1)

    GenerationConfig(cache_implementation="static", **GREEDY).save_pretrained(tmp_path / "static")
    static = GenerationConfig.from_pretrained(tmp_path / "static")
    with pytest.raises(LeanKCacheError, match="cache_implementation='static'"):
        lk.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=static)
    lk.model.generation_config.cache_implementation = "static"
    with pytest.raises(LeanKCacheError, match="cache_implementation"):
        lk.generate(ids, attention_mask=torch.ones_like(ids), **GREEDY)


def test_second_turn_reuses_the_leank_cache():
    """A returned LeanK cache carries a conversation on (dense tokens for a full mask); a dense one is refused."""
    model = tiny_model("llama")
    ids, turn2, first, second, kw = dense_two_turns(model)

    LeanKModel(model, full_mask())
    out = model.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True, **kw)
    cache = generated_cache(out)
    assert torch.equal(out.sequences, first) and isinstance(cache, LeanKCache)
    middle = cache.region_lengths()["middle"]
    assert torch.equal(hf_generate(model, turn2, cache=cache, **kw), second)
    assert cache.region_lengths()["middle"] > middle

    with pytest.raises(LeanKCacheError, match="DynamicCache"):
        hf_generate(model, turn2, cache=DynamicCache(config=model.config), **kw)


def test_pruned_second_turn_holds_pruned_bytes():
    mask = random_mask(ratio=0.6)
    lk = LeanKModel(tiny_model("qwen2"), mask)
    ids = prompt(30, seed=5)
    cache = lk.new_cache()
    first = lk.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, **GREEDY)
    turn2 = torch.cat([first, prompt(9, seed=6)], 1)
    lk.model.generate(turn2, attention_mask=torch.ones_like(turn2), **{CACHE_KWARG: cache}, **GREEDY)
    assert_held_leank(cache, mask, turn2.shape[1] + 16 - 1)


def test_decoding_over_a_dense_cache_is_refused_by_the_attention():
    """A hand-written decode loop over a dense cache (forward, not generate) stops at the first step."""
    model = tiny_model("llama")
    LeanKModel(model, random_mask())
    ids = prompt(20)
    dense = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(ids, **{CACHE_KWARG: dense}).logits  # a prefill is dense attention: allowed
        with pytest.raises(LeanKCacheError, match="set_attn_implementation"):
            model(logits[:, -1:].argmax(-1), **{CACHE_KWARG: dense})
        out = model(ids)  # a plain forward (a loss) is dense, as LeanK's prefill: allowed, it returns a cache
        with pytest.raises(LeanKCacheError, match="not a LeanKCache"):
            model(out.logits[:, -1:].argmax(-1), **{CACHE_KWARG: getattr(out, CACHE_KWARG)})


def test_use_cache_false_is_refused():
    lk = LeanKModel(tiny_model("llama"), random_mask())
    ids = prompt(12)
    with pytest.raises(LeanKCacheError, match="use_cache=False"):
        lk.model.generate(ids, attention_mask=torch.ones_like(ids), use_cache=False, max_new_tokens=2)


@pytest.mark.parametrize("how", ["assistant_model", "prompt_lookup_num_tokens"])
def test_assisted_decoding_verifies_over_the_leank_cache(how, built_caches):
    """Speculative decoding: the LeanK target verifies drafts over its cache and crops the rejected ones."""
    ids = prompt(40, seed=7)
    ids[0, 20:30] = ids[0, 5:15]  # something for prompt lookup to find
    extra = {"assistant_model": tiny_model("llama", seed=1)} if how == "assistant_model" else {how: 3}
    model = tiny_model("llama")
    want = hf_generate(model, ids, **GREEDY)
    LeanKModel(model, full_mask())
    assert torch.equal(hf_generate(model, ids, **GREEDY, **extra), want)

    mask = random_mask(ratio=0.6)
    lk = LeanKModel(tiny_model("llama"), mask)
    out = lk.model.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True, **GREEDY, **extra)
    assert_held_leank(generated_cache(out), mask, 40 + 16 - 1)


def test_dense_context_runs_the_model_own_attention(built_caches):
    model = tiny_model("mistral")
    ids = prompt(30, seed=8)
    want = hf_generate(model, ids, **GREEDY)
    impl = model.config._attn_implementation
    lk = LeanKModel(model, random_mask(ratio=0.7))
    with lk.dense():
        assert model.config._attn_implementation == impl
        assert torch.equal(hf_generate(model, ids, cache=DynamicCache(config=model.config), **GREEDY), want)
    assert not built_caches and model.config._attn_implementation == "leank"
    assert not torch.equal(lk.generate(ids, attention_mask=torch.ones_like(ids), **GREEDY), want)


def test_cache_under_either_name_and_the_last_mask_wins(built_caches):
    model = tiny_model("llama")
    first, second = LeanKModel(model, random_mask(seed=1)), LeanKModel(model, random_mask(seed=2))
    ids = prompt(20, seed=9)
    a = first.generate(ids, attention_mask=torch.ones_like(ids), **GREEDY)
    assert built_caches[-1].mask is first.mask  # its own mask, though `second` wrapped the model since
    model.generate(ids, attention_mask=torch.ones_like(ids), **GREEDY)
    assert built_caches[-1].mask is second.mask
    for name in ("cache", "past_key_values"):
        cache = first.new_cache()
        assert torch.equal(first.generate(ids, attention_mask=torch.ones_like(ids), **{name: cache}, **GREEDY), a)
        assert cache.region_lengths()["total"] == 20 + 16 - 1
    with pytest.raises(TypeError, match="not both"):
        first.generate(ids, cache=first.new_cache(), past_key_values=first.new_cache())



@pytest.mark.slow
def test_readme_pipeline_on_the_embedded_model(embedded, built_caches):
    """The quick start's pipeline variant (docs/quickstart.md), on the embedded model and the committed mask."""
    model, tok = embedded
    m = LeanKModel.from_pretrained("hub/smollm2-135m-instruct", model=model, tokenizer=tok)
    pipe = pipeline("text-generation", model=m.model, tokenizer=m.tokenizer)
    facts = " ".join(f"Item {i} is {(i * 37) % 101}." for i in range(60))
    messages = [{"role": "user", "content": facts + " What is the capital of France?"}]
    reply = pipe(messages, max_new_tokens=16, do_sample=False)[0]["generated_text"][-1]["content"]
    assert reply.strip()
    (cache,) = built_caches
    n = len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    tokens = cache.region_lengths()["total"]
    assert n < tokens < n + 16
    assert_held_leank(cache, m.mask, tokens)
