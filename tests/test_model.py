"""LeanKModel end to end on tiny random models of every family (and one slow run on the embedded model)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from conftest import documented_recent_from, tiny_model
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from leank_infer import ChannelMask, LeanKModel, MaskError
from leank_infer.decode.cache import LeanKCache, dynamic_cache_bytes
from leank_infer.model.generation import CACHE_KWARG, cache_kwargs

pytestmark = pytest.mark.usefixtures("one_thread")


SIZES = dict(sink_size=4, recent_size=8, accumu_size=4)


def full_mask(**kw) -> ChannelMask:
    return ChannelMask.full(2, 2, 16, **{**SIZES, **kw})


def random_mask(seed: int = 0, ratio: float = 0.5, **kw) -> ChannelMask:
    """A mask over the tiny models (2 layers, 2 KV heads, head_dim 16) with mixed and zero kept counts."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(2, 2, 16, generator=g)
    scores[0, 0] *= 0.1  # this head falls under the threshold: zero channels
    mask = ChannelMask.from_scores(scores, ratio, 4, **{**SIZES, **kw})
    assert (mask.kept_counts == 0).any() and len(set(mask.kept_counts.flatten().tolist())) > 2
    return mask


def prompt(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def hf_generate(model, ids, **kw) -> torch.Tensor:
    """transformers' generate (a cache under either name); dense unless the model was wrapped by LeanK."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(kw))


def tiny_repo(tmp_path: Path, family: str = "llama", mask: ChannelMask | None = None) -> tuple[Path, object]:
    """A saved tiny model + word-level tokenizer, and a mask folder naming it as base model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}w3"
    model = tiny_model(family)
    model_dir = tmp_path / "base"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    mask = mask or random_mask()
    mask.base_model = str(model_dir)
    mask_dir = mask.save_pretrained(tmp_path / "mask")
    return mask_dir, model


def test_full_mask_generate_equals_hf(family):
    """Keeping every channel, LeanK decoding (with compressions happening) is dense decoding."""
    model = tiny_model(family)
    ids = prompt(40)
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    want = hf_generate(model, ids, **kw)
    lk = LeanKModel(model, full_mask())
    cache = lk.new_cache()
    got = lk.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **kw)
    assert torch.equal(got, want)
    assert cache.region_lengths()["middle"] > 40 - 4 - 8  # the accumulation buffer was compressed too


@pytest.mark.parametrize(
    "family,window",
    [("mistral", dict(sliding_window=16)), ("qwen2", dict(use_sliding_window=True, sliding_window=16))],
)
def test_sliding_window_layers_follow_the_model_mask(family, window):
    """Sliding-window layers get their window from the model's mask (the LeanK cache keeps every token)."""
    model = tiny_model(family, max_window_layers=1, **window)
    ids = prompt(40, seed=9)
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    want = hf_generate(model, ids, **kw)
    got = LeanKModel(model, full_mask()).generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(got, want)


def dense_two_turns(model):
    """A two-turn conversation decoded dense on one DynamicCache: (ids, turn2, first, second, generate kwargs)."""
    ids = prompt(30, seed=1)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    dense = DynamicCache(config=model.config)
    first = hf_generate(model, ids, cache=dense, **kw)
    turn2 = torch.cat([first, prompt(7, seed=2)], 1)
    second = hf_generate(model, turn2, cache=dense, **kw)
    return ids, turn2, first, second, kw


def test_cache_reused_across_generate_calls_equals_hf():
    """A second turn on the same cache feeds only the new tokens, on top of the compressed middle."""
    model = tiny_model("llama")
    ids, turn2, first, second, kw = dense_two_turns(model)
    lk = LeanKModel(model, full_mask())
    cache = lk.new_cache()
    assert torch.equal(lk.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **kw), first)
    middle = cache.region_lengths()["middle"]
    assert torch.equal(lk.generate(turn2, attention_mask=torch.ones_like(turn2), cache=cache, **kw), second)
    assert cache.region_lengths()["middle"] > middle


def test_sampling_chunked_prefill_and_beams_equal_hf():
    model = tiny_model("qwen2")
    ids = prompt(37, seed=1)
    lk = LeanKModel(model, full_mask())
    for kw in (
        dict(do_sample=True, top_k=20, temperature=0.9),
        dict(do_sample=False, prefill_chunk_size=16),
        dict(do_sample=False, num_beams=2),
    ):
        torch.manual_seed(0)
        with lk.dense():
            want = hf_generate(model, ids, max_new_tokens=12, **kw)
        torch.manual_seed(0)
        got = lk.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, **kw)
        assert torch.equal(got, want), kw


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_left_padded_batch_equals_each_prompt_alone(family):
    """Each row of a left-padded batch decodes as that prompt alone: same logits at every step (the sink and
    the recent window count from the row's first real token), with a mask that changes the padded row's logits."""
    model = tiny_model(family)
    lk = LeanKModel(model, random_mask(seed=1))
    a, b = prompt(30, seed=2)[0], prompt(17, seed=3)[0]
    batch = torch.zeros(2, 30, dtype=torch.long)
    attn = torch.zeros(2, 30, dtype=torch.long)
    batch[0], attn[0] = a, 1
    batch[1, 13:], attn[1, 13:] = b, 1
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    both = lk.generate(batch, attention_mask=attn, **kw)
    for row, ids in ((0, a), (1, b)):
        ones = torch.ones(1, len(ids), dtype=torch.long)
        alone = lk.generate(ids[None], attention_mask=ones, **kw)
        assert torch.equal(both.sequences[row, 30:], alone.sequences[0, len(ids) :]), row
        for step, (x, y) in enumerate(zip(both.logits, alone.logits, strict=True)):
            torch.testing.assert_close(x[row], y[0], atol=2e-5, rtol=1e-4, msg=f"row {row} step {step}")
    # the comparison can fail: the padded row's prompt is past sink + recent, and pruning moves its logits
    with lk.dense():
        dense = hf_generate(model, b[None], **kw)
    alone = lk.generate(b[None], attention_mask=torch.ones(1, 17, dtype=torch.long), **kw)
    assert not torch.allclose(torch.stack(alone.logits), torch.stack(dense.logits), atol=1e-4)


def _first_step_rule_attention(mask: ChannelMask):
    """An attention function: dense for every query but the last, which follows the LeanK rule over full K/V
    (middle keys scored with the kept channels only; a zero head skips them). Over a prompt + one token this
    is what the first decode step after that prompt's prefill must compute (docs/rule.md, "The rules"), from positions alone."""
    from leank_infer.decode.masked_attention import leank_attention

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scaling = module.scaling if scaling is None else scaling
        n, hkv, d = query.shape[2], key.shape[1], key.shape[3]
        args = (query, key, value)
        dense = leank_attention(*args, torch.ones(hkv, d), torch.arange(n), 0, 0, scaling)
        last = leank_attention(query[:, :, -1:], key, value, mask.keep[module.layer_idx].float(),
                               torch.tensor([n - 1]), mask.sink_size, mask.recent_size, scaling,
                               skip_zero_heads=True, accumu_size=mask.accumu_size)
        return torch.cat([dense[:, :-1], last], 1), None

    return attend


def test_pruning_changes_decoding_but_not_prefill():
    """A real mask prunes: prefill logits stay dense, and the first decode step is the LeanK rule's
    (computed over full K/V from token positions), which differs from dense decoding."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    model = tiny_model("llama")
    ids = prompt(60, seed=4)
    dense = model(ids).logits
    mask = random_mask(ratio=0.7)
    lk = LeanKModel(model, mask)
    cache = lk.new_cache()
    with torch.no_grad():
        out = lk(ids, cache=cache)
        torch.testing.assert_close(out.logits, dense, atol=1e-5, rtol=1e-5)
        nxt = out.logits[:, -1:].argmax(-1)
        dense_next = model(torch.cat([ids, nxt], 1)).logits[:, -1]
        leank_next = lk(nxt, cache=cache).logits[:, -1]
        AttentionInterface.register("leank_first_step_ref", _first_step_rule_attention(mask))
        AttentionMaskInterface.register("leank_first_step_ref", sdpa_mask)
        impl = model.config._attn_implementation
        model.set_attn_implementation("leank_first_step_ref")
        try:
            rule_next = model(torch.cat([ids, nxt], 1)).logits[:, -1]
        finally:
            model.set_attn_implementation(impl)
    torch.testing.assert_close(leank_next, rule_next, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(leank_next, dense_next, atol=1e-4)


def test_kv_bytes_for_2048_tokens_follow_the_mask_formula():
    model = tiny_model("llama")
    mask = random_mask(ratio=0.7, sink_size=16, recent_size=64, accumu_size=16)
    lk = LeanKModel(model, mask)
    ids = prompt(2048, seed=5)
    cache, dense = lk.new_cache(), DynamicCache(config=model.config)
    with torch.no_grad():
        lk(ids, cache=cache)
        model(ids, **{CACHE_KWARG: dense})
    got = lk.kv_cache_bytes(cache)
    assert got == mask.kv_cache_bytes(2048, 1, torch.float32)
    assert got < dynamic_cache_bytes(dense) == 2048 * mask.kv_bytes_per_token(torch.float32)["dense"]


def test_kv_bytes_after_many_decode_steps_follow_the_schedule():
    """Through 40 decode steps (ten compressions), the cache holds exactly the rule's bytes: sink + r full
    tokens and the rest pruned, r computed here from the sizes and positions alone (docs/rule.md, "The rules"):
    the query at p sees full keys [rf(p), p], rf(p) = recent keys back rounded down to a multiple of accumu,
    so recent + 1 <= r <= recent + accumu."""
    model = tiny_model("llama")
    mask = random_mask(ratio=0.7)  # sink 4, recent 8, accumu 4
    lk = LeanKModel(model, mask)
    per = mask.kv_bytes_per_token(torch.float32)
    ids = prompt(40, seed=11)
    cache = lk.new_cache()
    seen = []
    with torch.no_grad():
        logits = lk(ids, cache=cache).logits[:, -1]
        total = 40
        for _ in range(40):
            logits = lk(logits.argmax(-1, keepdim=True), cache=cache).logits[:, -1]
            total += 1
            r = total - documented_recent_from(total - 1, mask.recent_size, mask.accumu_size)
            full = mask.sink_size + r
            assert cache.nbytes() == full * per["dense"] + (total - full) * per["leank_middle"], total
            seen.append(r)
    assert min(seen) == mask.recent_size + 1 and max(seen) == mask.recent_size + mask.accumu_size
    assert cache.nbytes() < total * per["dense"]


def assert_beam_scores_are_their_sequences_decoded_alone(lk, ids, out, new: int) -> None:
    """Each beam's score is the sum of its tokens' log-probabilities decoded step by step in a fresh cache: a
    reordered cache that served another beam's keys would change them."""
    n = ids.shape[1]
    for seq, score in zip(out.sequences, out.sequences_scores, strict=True):
        cache = lk.new_cache()
        with torch.no_grad():
            logp = [torch.log_softmax(lk(ids, cache=cache).logits[0, -1].float(), -1)]
            for t in range(n, n + new - 1):
                logp.append(torch.log_softmax(lk(seq[None, t : t + 1], cache=cache).logits[0, -1].float(), -1))
        alone = sum(float(lp[seq[n + i]]) for i, lp in enumerate(logp))
        assert score.item() == pytest.approx(alone, abs=1e-4)


def test_beam_search_reorders_a_pruned_cache():
    """Beams swap places during the search: each returned beam's score equals that sequence decoded alone,
    one token at a time through a fresh LeanK cache (a cache not reordered with its beam would mix them).
    Recent 4 / accumu 2 after a 12-token prompt: generated tokens reach the compressed middle early."""
    model = tiny_model("qwen3")
    lk = LeanKModel(model, random_mask(seed=2, ratio=0.7, recent_size=4, accumu_size=2))
    ids, new = prompt(12, seed=12), 30
    kw = dict(num_beams=3, num_return_sequences=3, max_new_tokens=new, min_new_tokens=new, do_sample=False,
              length_penalty=0.0, early_stopping=True)
    out = lk.generate(ids, attention_mask=torch.ones_like(ids), output_scores=True, return_dict_in_generate=True,
                      **kw)
    assert len({tuple(s.tolist()) for s in out.sequences}) == 3
    assert (out.beam_indices[:, 10:new] != out.beam_indices[:, 9:new - 1]).any()  # beams swapped late
    with lk.dense():
        assert not torch.equal(hf_generate(model, ids, **kw), out.sequences)  # the search itself is pruned
    assert_beam_scores_are_their_sequences_decoded_alone(lk, ids, out, new)


def test_dense_until_is_dense_generate_below_and_the_leank_rule_above(family):
    """The short-context switch: with ``dense_until`` past the whole sequence a pruning mask decodes exactly
    as plain transformers (every entry point: ``LeanKModel.generate`` and the wrapped model's own
    ``generate``); once a sequence crosses it the cache is compressed (the saving starts there)."""
    model = tiny_model(family)
    ids = prompt(30, batch=2)
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    want = hf_generate(model, ids, **kw)
    pruned = hf_generate(LeanKModel(model, random_mask()).model, ids, **kw)
    assert not torch.equal(pruned, want), "this mask should change greedy decoding"
    lk = LeanKModel(model, random_mask(), dense_until=10_000)
    cache = lk.new_cache()
    assert torch.equal(lk.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **kw), want)
    assert cache.region_lengths()["middle"] == 0
    assert torch.equal(hf_generate(lk.model, ids, **kw), want)  # the model's generate builds the same cache
    crossing = LeanKModel(model, random_mask(), dense_until=35)
    cache = crossing.new_cache()
    got = crossing.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **kw)
    assert torch.equal(got[:, :36], want[:, :36])  # the prefill's token and the 5 steps from 30 to 34 tokens: dense
    assert cache.region_lengths()["middle"] > 0
    with pytest.raises(ValueError, match="dense_until"):
        LeanKModel(model, random_mask(), dense_until=-5)


def test_mismatched_mask_is_refused_before_touching_the_model():
    model = tiny_model("llama")
    impl = model.config._attn_implementation
    wrong = ChannelMask.full(3, 2, 16, **SIZES)
    with pytest.raises(MaskError, match="num_layers"):
        LeanKModel(model, wrong)
    assert model.config._attn_implementation == impl
    with pytest.raises(MaskError, match="head_dim"):
        LeanKModel(model, ChannelMask.full(2, 2, 32, **SIZES))


def test_short_prompt_runs_unpruned():
    model = tiny_model("mistral")
    ids = prompt(6, seed=6)
    want = hf_generate(model, ids, max_new_tokens=6, do_sample=False)
    lk = LeanKModel(model, random_mask(ratio=0.7))
    cache = lk.new_cache()
    got = lk.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, cache=cache
    )
    assert torch.equal(got, want)
    assert cache.region_lengths()["middle"] == 0
    assert (
        cache.nbytes() == cache.region_lengths()["total"] * lk.mask.kv_bytes_per_token(torch.float32)["dense"]
    )


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


class _StopAfter(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_streamer_and_stopping_criteria():
    model = tiny_model("llama")
    lk = LeanKModel(model, random_mask())
    ids = prompt(30, seed=7)
    streamer = _Collect()
    out = lk.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=50,
        do_sample=False,
        streamer=streamer,
        stopping_criteria=StoppingCriteriaList([_StopAfter(30 + 7)]),
    )
    assert out.shape[1] == 37
    assert streamer.ended
    assert sum(streamer.chunks, []) == out[0].tolist()  # the prompt, then each new token


def test_forward_without_leank_cache_is_dense():
    model = tiny_model("qwen3")
    ids = prompt(20, seed=8)
    with torch.no_grad():
        want = model(ids).logits
        lk = LeanKModel(model, random_mask())
        assert torch.allclose(lk(ids).logits, want, atol=1e-6)
        assert isinstance(lk.new_cache(), LeanKCache)


def test_from_pretrained_loads_base_model_and_tokenizer(tmp_path):
    mask_dir, _ = tiny_repo(tmp_path)
    lk = LeanKModel.from_pretrained(mask_dir)
    assert lk.model.config._attn_implementation == "leank"
    assert lk.tokenizer is not None and torch.equal(lk.mask.keep, ChannelMask.from_pretrained(mask_dir).keep)
    enc = lk.tokenizer("w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18", return_tensors="pt")
    out = lk.generate(**enc, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 14 + 5)


def test_from_pretrained_with_model_checks_shape_and_base_model(tmp_path):
    mask_dir, _ = tiny_repo(tmp_path)
    other = tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(MaskError):
        LeanKModel.from_pretrained(mask_dir, model=other)
    mask = ChannelMask.from_pretrained(mask_dir)
    mask.base_model = "org/some-model"
    mask.save_pretrained(mask_dir)
    given = tiny_model("llama")
    given.config._name_or_path = "org/another-model"
    with pytest.raises(MaskError, match="org/some-model.*org/another-model"):
        LeanKModel.from_pretrained(mask_dir, model=given)
    assert given.config._attn_implementation != "leank"  # refused before the model was touched
    with pytest.warns(UserWarning, match="org/some-model"):
        lk = LeanKModel.from_pretrained(mask_dir, model=given, check_base_model=False)
    assert lk.model is given


def test_from_pretrained_applies_the_masks_config_overrides(tmp_path):
    """A mask learned with YaRN loads its base model with YaRN (hf_kwargs of the same name win); a
    given model without it is refused, naming the override (used with a warning on opt-out)."""
    mask_dir, _ = tiny_repo(tmp_path)
    mask = ChannelMask.from_pretrained(mask_dir)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 10000.0}
    mask.config_overrides = {"rope_parameters": yarn}
    mask.save_pretrained(mask_dir)
    lk = LeanKModel.from_pretrained(mask_dir)
    rope = lk.model.config.rope_parameters
    assert {k: rope[k] for k in yarn} == yarn
    plain = LeanKModel.from_pretrained(mask_dir, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert plain.model.config.rope_parameters["rope_type"] == "default"
    ids = torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # YaRN changes the model (attention temperature, rotary frequencies)
        assert not torch.allclose(lk(ids).logits, plain(ids).logits, atol=1e-4)
    with pytest.raises(MaskError, match="rope_parameters: model has"):  # the vLLM plugin's check too
        LeanKModel.from_pretrained(mask_dir, model=plain.model)
    with pytest.warns(UserWarning, match="rope_parameters: model has"):
        LeanKModel.from_pretrained(mask_dir, model=plain.model, check_base_model=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LeanKModel.from_pretrained(mask_dir, model=lk.model)  # carries them: no warning


@pytest.mark.slow
def test_embedded_model_generates_with_a_pruned_cache(embedded):
    model, tok = embedded
    mask = ChannelMask.from_scores(
        torch.rand(30, 3, 64, generator=torch.Generator().manual_seed(0)),
        0.7,
        16,
        sink_size=16,
        recent_size=64,
        accumu_size=16,
    )
    lk = LeanKModel(model, mask, tok)
    text = " ".join(f"Item {i} is {(i * 37) % 101}." for i in range(100)) + " What is item 7?"
    enc = tok(text, return_tensors="pt")
    n = enc["input_ids"].shape[1]
    assert 500 < n < 900
    cache = lk.new_cache()
    out = lk.generate(**enc, max_new_tokens=16, do_sample=False, cache=cache)
    assert out.shape[1] > n
    dense = (out.shape[1] - 1) * mask.kv_bytes_per_token(torch.float32)["dense"]
    assert cache.nbytes() < dense
    assert cache.region_lengths()["middle"] >= n - 16 - 64
    assert tok.decode(out[0, n:], skip_special_tokens=True).strip()
