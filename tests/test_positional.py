"""rule="positional" on the HF path: every query, the prompt's included, by the LeanK rule of its position alone.

The reference is ``leank_attention(..., accumu_size=A)`` over the uncompressed K/V (a whole forward of the
sequence so far per generated token); the LeanK model decodes through its cache. Chunked prefill, several
forwards, assisted decoding and beam search must give what one prefill gives. The layer-level checks (left
padding, several compressions, a head keeping nothing, several tokens at once) are in ``tests/test_cache.py``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_model import SIZES, assert_beam_scores_are_their_sequences_decoded_alone, prompt, random_mask

from leank_infer import ChannelMask, LeanKModel
from leank_infer.decode.attention import dense_attention
from leank_infer.decode.cache import LeanKCache, fill_from_prefill
from leank_infer.decode.masked_attention import leank_attention
from leank_infer.decode.rule import RULES

pytestmark = pytest.mark.usefixtures("one_thread")

REF = "leank_positional_ref"
GREEDY = dict(do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)


def left_padded(lengths: list[int], seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of ``lengths`` tokens, left-padded to the longest: (input_ids, attention_mask)."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = prompt(n, seed=seed + row)[0]
        attn[row, width - n :] = 1
    return ids, attn


def positions(attn: torch.Tensor) -> torch.Tensor:
    """``position_ids`` as generate numbers them: real tokens from 0, padding at 1."""
    return (attn.cumsum(-1) - 1).masked_fill(attn == 0, 1)


def reference_greedy(model, mask: ChannelMask, ids: torch.Tensor, attn: torch.Tensor, new: int, dense_prompt: bool = False):
    """Greedy decoding (never the end-of-sequence token, as ``min_new_tokens``) where every forward is the whole
    sequence so far under ``leank_attention(accumu_size=A)`` (no cache): (sequences, per-step last logits).
    ``dense_prompt``: queries of the prompt (padded index below its width) by the model's dense attention
    instead (the ``"dense-prompt"`` rule)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    starts = (attn == 0).long().cumprod(-1).sum(-1)
    width = ids.shape[1]

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
        if module.layer_idx in mask.dense_layers:  # a sliding layer (Gemma 2): the model's own attention
            return dense_attention(module, query, key, value, attention_mask, scaling, softcap)
        n, k = query.shape[2], key.shape[2]
        out = leank_attention(query, key, value, mask.keep[module.layer_idx].float(), torch.arange(k - n, k),
                              mask.sink_size, mask.recent_size, scaling, key_start=starts, skip_zero_heads=True,
                              softcap=softcap, accumu_size=mask.accumu_size)
        if dense_prompt:
            in_prompt = torch.arange(k - n, k) < width
            dense = dense_attention(module, query, key, value, attention_mask, scaling, softcap)[0]
            out[:, in_prompt] = dense[:, in_prompt].to(out.dtype)
        return out, None

    AttentionInterface.register(REF, attend)
    AttentionMaskInterface.register(REF, sdpa_mask)
    impl = model.config._attn_implementation
    model.set_attn_implementation(REF)
    logits = []
    try:
        with torch.no_grad():
            for _ in range(new):
                last = model(ids, attention_mask=attn, position_ids=positions(attn)).logits[:, -1]
                logits.append(last)
                pick = last.clone()
                pick[:, model.config.eos_token_id] = float("-inf")  # as generate's min_new_tokens does
                ids = torch.cat([ids, pick.argmax(-1, keepdim=True)], 1)
                attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
    finally:
        model.set_attn_implementation(impl)
    return ids, logits


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_greedy_generate_equals_the_reference_loop(family):
    """A left-padded batch, greedy, rule="positional": the same tokens and logits as a loop of whole forwards
    under the reference rule; and not those of the default rule (which prefills densely), so the test can tell.
    Gemma 2: the soft-capped logits, its sliding layer kept dense by the mask."""
    model = tiny_model(family)
    mask = random_mask(seed=1)
    if family == "gemma2":  # its layer 0 slides: the mask keeps it dense (the model's own cache and attention)
        mask = ChannelMask.from_scores(torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(1)), 0.5, 4,
                                       dense_layers=(0,), **SIZES)
    ids, attn = left_padded([30, 21, 26])
    new = 24
    lk = LeanKModel(model, mask, rule="positional")
    got = lk.generate(ids, attention_mask=attn, max_new_tokens=new, min_new_tokens=new, **GREEDY)
    want_ids, want_logits = reference_greedy(model, mask, ids, attn, new)
    for step, (x, y) in enumerate(zip(got.logits, want_logits, strict=True)):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4, msg=f"step {step}")
    assert torch.equal(got.sequences, want_ids)
    default = LeanKModel(model, mask).generate(ids, attention_mask=attn, max_new_tokens=new, min_new_tokens=new, **GREEDY)
    assert not torch.allclose(torch.stack(default.logits), torch.stack(got.logits), atol=1e-4)


def test_chunked_prefill_and_several_forwards_equal_one_prefill():
    """The prompt in chunks (generate's ``prefill_chunk_size``, or forwards of any sizes) gives the logits, the
    tokens and the stored cache of one prefill: the rule depends on positions alone. Rows are left-padded by less
    than a chunk (a chunk that is all padding for a row cannot tell the cache where that row starts)."""
    model = tiny_model("llama")
    mask = random_mask(seed=1)
    lk = LeanKModel(model, mask, rule="positional")
    ids, attn = left_padded([37, 33, 31])
    kw = dict(max_new_tokens=12, min_new_tokens=12, **GREEDY)
    whole = lk.generate(ids, attention_mask=attn, **kw)
    for chunk in (7, 16, 37):
        got = lk.generate(ids, attention_mask=attn, prefill_chunk_size=chunk, **kw)
        assert torch.equal(got.sequences, whole.sequences), chunk
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(whole.logits), atol=2e-5, rtol=1e-4)
    default = LeanKModel(model, mask).generate(ids, attention_mask=attn, **kw)  # dense-prompt: another rule
    assert not torch.allclose(torch.stack(default.logits), torch.stack(whole.logits), atol=1e-4)

    one, pieces = lk.new_cache(), lk.new_cache()
    pos = positions(attn)
    with torch.no_grad():
        want = lk(ids, attention_mask=attn, position_ids=pos, cache=one).logits
        got = [lk(ids[:, a:b], attention_mask=attn[:, :b], position_ids=pos[:, a:b], cache=pieces).logits
               for a, b in ((0, 9), (9, 10), (10, 27), (27, 37))]
    torch.testing.assert_close(torch.cat(got, 1)[attn.bool()], want[attn.bool()], atol=2e-5, rtol=1e-4)
    # a prefill compresses at once for the next query; pieces compress before each forward: after the next
    # token the two caches hold the same regions and keys
    step = dict(attention_mask=torch.cat([attn, torch.ones_like(attn[:, :1])], 1), position_ids=pos[:, -1:] + 1)
    with torch.no_grad():
        nxt = want[:, -1:].argmax(-1)
        torch.testing.assert_close(lk(nxt, cache=pieces, **step).logits, lk(nxt, cache=one, **step).logits,
                                   atol=2e-5, rtol=1e-4)
    for x, y in zip(one.layers, pieces.layers, strict=True):
        assert (x.head_len, x.mid_len, x.tail_len) == (y.head_len, y.mid_len, y.tail_len)
        torch.testing.assert_close(x.layout().mid_v, y.layout().mid_v, atol=1e-5, rtol=1e-4)
    assert one.region_lengths()["middle"] > 0


@pytest.mark.parametrize("how", ["assistant_model", "prompt_lookup_num_tokens"])
def test_assisted_decoding_equals_greedy(how):
    """Speculative decoding verifies several tokens per forward and crops the rejected ones: under the positional
    rule it returns plain greedy decoding's tokens (the verified tokens see what one token at a time sees)."""
    ids = prompt(40, seed=7)
    ids[0, 20:30] = ids[0, 5:15]  # something for prompt lookup to find
    extra = {"assistant_model": tiny_model("llama", seed=1)} if how == "assistant_model" else {how: 3}
    lk = LeanKModel(tiny_model("llama"), random_mask(seed=1), rule="positional")
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    want = lk.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    got = lk.generate(ids, attention_mask=torch.ones_like(ids), **kw, **extra)
    assert torch.equal(got, want)


def test_beam_search_reorders_a_positional_cache():
    """Beams swap places: each returned beam's score is that sequence's, decoded alone one token at a time."""
    model = tiny_model("qwen3")
    lk = LeanKModel(model, random_mask(seed=2, ratio=0.7, recent_size=4, accumu_size=2), rule="positional")
    ids, new = prompt(12, seed=12), 30
    kw = dict(num_beams=3, num_return_sequences=3, max_new_tokens=new, min_new_tokens=new, do_sample=False,
              length_penalty=0.0, early_stopping=True)
    out = lk.generate(ids, attention_mask=torch.ones_like(ids), output_scores=True, return_dict_in_generate=True,
                      **kw)
    assert (out.beam_indices[:, 10:new] != out.beam_indices[:, 9:new - 1]).any()  # beams swapped late
    assert_beam_scores_are_their_sequences_decoded_alone(lk, ids, out, new)


def test_rows_selected_or_repeated_decode_as_before():
    """``batch_select_indices`` / ``batch_repeat_interleave`` keep each row's start and stored keys: a selected
    row, and repeated rows, continue as that row of the whole batch does."""
    model = tiny_model("llama")
    lk = LeanKModel(model, random_mask(seed=1), rule="positional")
    ids, attn = left_padded([30, 21])
    pos = positions(torch.cat([attn, torch.ones(2, 12, dtype=torch.long)], 1))
    steps = prompt(12, seed=9, batch=2)

    def run(cache, rows, first, last):
        out = []
        with torch.no_grad():
            for t in range(first, last):
                m = torch.cat([attn, torch.ones(2, t + 1, dtype=torch.long)], 1)[rows]
                out.append(lk(steps[rows, t : t + 1], attention_mask=m, position_ids=pos[rows, 30 + t : 31 + t],
                              cache=cache).logits[:, -1])
        return torch.stack(out, 1)

    whole = lk.new_cache()
    with torch.no_grad():
        lk(ids, attention_mask=attn, position_ids=pos[:, :30], cache=whole)
    run(whole, [0, 1], 0, 6)
    select, repeat = lk.new_cache(), lk.new_cache()
    for c in (select, repeat):
        c.layers = [__import__("copy").deepcopy(layer) for layer in whole.layers]
    want = run(whole, [0, 1], 6, 12)
    select.batch_select_indices(torch.tensor([1]))
    torch.testing.assert_close(run(select, [1], 6, 12), want[1:], atol=2e-5, rtol=1e-4)
    repeat.batch_repeat_interleave(2)
    torch.testing.assert_close(run(repeat, [0, 0, 1, 1], 6, 12), want[[0, 0, 1, 1]], atol=2e-5, rtol=1e-4)


def test_crop_keeps_what_the_next_query_needs():
    """crop drops recent tokens while every key the next query scores with all channels is still whole; going
    back past the compressed middle is refused with the reason."""
    lk = LeanKModel(tiny_model("llama"), random_mask(seed=1), rule="positional")
    cache = lk.new_cache()
    ids = prompt(40, seed=3)
    with torch.no_grad():
        lk(ids[:, :30], cache=cache)
        for t in range(30, 36):
            lk(ids[:, t : t + 1], cache=cache)
        layer = cache.layers[0]
        assert layer.mid_len > 0
        cache.crop(-3)  # back to 33 tokens
        after = lk(ids[:, 33:34], cache=cache).logits[:, -1]
        fresh = lk.new_cache()
        lk(ids[:, :30], cache=fresh)
        want = [lk(ids[:, t : t + 1], cache=fresh).logits[:, -1] for t in range(30, 34)][-1]
    torch.testing.assert_close(after, want, atol=2e-5, rtol=1e-4)
    # back to just after the middle: those tokens are whole, but the query there needs recent keys that the
    # middle holds with the kept channels only
    assert layer.tail_len > 1
    with pytest.raises(ValueError, match="uncompressed"):
        cache.crop(-(layer.tail_len - 1))
    with pytest.raises(ValueError, match="uncompressed"):
        cache.crop(-(cache.get_seq_length() - layer.head_len - layer.mid_len + 2))


def test_rule_options_are_checked():
    """One clear error for an unknown rule, for the retired one (naming its replacement), and for dense_until under
    the positional rule (it has no meaning there: every query follows the rule from the prompt on); the default
    rule is dense-prompt, the vLLM plugin's."""
    model = tiny_model("llama")
    mask = random_mask()
    assert LeanKModel(model, mask).rule == "dense-prompt" == RULES[0]
    assert LeanKModel(model, mask).new_cache().layers[0].rule == "dense-prompt"
    with pytest.raises(ValueError, match="rule must be one of 'dense-prompt', 'positional', got 'vllm'"):
        LeanKModel(model, mask, rule="vllm")
    for make in (lambda: LeanKModel(model, mask, rule="dense-prefill"), lambda: LeanKCache(mask, rule="dense-prefill")):
        with pytest.raises(ValueError, match="rule 'dense-prefill' is retired: use 'dense-prompt'"):
            make()
    for make in (lambda: LeanKModel(model, mask, dense_until=64, rule="positional"),
                 lambda: LeanKCache(mask, dense_until=64, rule="positional")):
        with pytest.raises(ValueError, match="dense_until=64 has no meaning under rule='positional'"):
            make()
    cache = LeanKCache(mask, rule="positional")
    kv = [torch.randn(1, 2, 20, 16)] * 2
    with pytest.raises(ValueError, match="cannot be filled from a dense prefill"):
        fill_from_prefill(cache, kv, kv)
    assert "rule='positional'" in repr(LeanKModel(model, mask, rule="positional"))


def test_a_second_wrapper_decodes_with_its_own_rule():
    """Two LeanKModels over one model object: each generate decodes with its own mask and rule."""
    model = tiny_model("llama")
    ids = prompt(30, seed=5)
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    positional = LeanKModel(model, random_mask(seed=1), rule="positional")
    want = positional.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    default = LeanKModel(model, positional.mask)
    other = default.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(positional.generate(ids, attention_mask=torch.ones_like(ids), **kw), want)
    assert not torch.equal(other, want)


def test_evaluation_prefills_positional_methods_on_their_own(tmp_path):
    """The evaluation shares one dense prefill between methods; a method decoding by the positional rule prefills
    on its own (its prompt attends by its mask): each row's answer is that prompt's own ``generate`` under the
    rule, alone and unpadded, next to the dense-prompt methods' answers of the same batch."""
    from test_eval_scoring import _decode
    from test_model import tiny_repo

    from leank_train.evaluate import random_mask_like, think_mask
    from leank_train.evaluation.loop import answer_batch
    from leank_train.evaluation.methods import Full, Learned, RandomChannels, ThinK

    scores = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(1))
    mask = ChannelMask.from_scores(scores, 0.75, 4, sink_size=4, recent_size=8, accumu_size=4)
    mask_dir, _ = tiny_repo(tmp_path, family="qwen3", mask=mask)
    lm = LeanKModel.from_pretrained(mask_dir)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (64, 41, 57)]
    methods = [Full(), Learned(), Learned("leank-pos", rule="positional"), RandomChannels("random-pos", seed=7,
               rule="positional"), ThinK("think-pos", rule="positional")]
    got = answer_batch(lm, methods, prompts, [16, 16, 9])
    rnd = random_mask_like(lm.mask, seed=7)
    differ = 0
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        n = 9 if i == 2 else 16
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        own = {"leank-pos": lm.mask, "random-pos": rnd, "think-pos": think_mask(lm.model, ids, lm.mask)}
        for name, m in own.items():
            out = LeanKModel(lm.model, m, lm.tokenizer, rule="positional").generate(
                **inputs, max_new_tokens=n, do_sample=False)
            assert got[name][i] == lm.tokenizer.decode(out[0, len(p):], skip_special_tokens=True), (name, i)
        assert got["leank"][i] == _decode(lm, lm.mask, inputs, n)
        differ += got["leank"][i] != got["leank-pos"][i]
    assert differ, "the rules should answer differently here (else the test cannot tell them apart)"
    # the evaluated model's rule is the methods' default
    positional = LeanKModel(lm.model, lm.mask, lm.tokenizer, rule="positional")
    assert answer_batch(positional, [Learned()], prompts, [16, 16, 9])["leank"] == got["leank-pos"]


def test_rule_on_the_command_lines(tmp_path, capsys, monkeypatch):
    """--rule positional reaches the model of leank generate / bench / eval; a bad rule, and --dense-until with
    the positional rule, are one usage error each."""
    from test_model import tiny_repo

    import leank_train.evaluate as ev
    from leank_infer.cli import main

    mask_dir, _ = tiny_repo(tmp_path, mask=random_mask(seed=1))
    text = " ".join(f"w{3 + (i * 7) % 120}" for i in range(40))
    assert main(["generate", str(mask_dir), "--prompt", text, "--max-new-tokens", "8", "--rule", "positional"]) == 0
    out = capsys.readouterr().out
    assert "rule positional" in out
    lk = LeanKModel.from_pretrained(mask_dir, rule="positional")
    enc = lk.tokenizer(text, return_tensors="pt")
    want = lk.tokenizer.decode(lk.generate(**enc, max_new_tokens=8, do_sample=False)[0, 40:], skip_special_tokens=True)
    assert want.strip() and want.strip().split()[0] in out.split(" | ")[-1]

    assert main(["bench", str(mask_dir), "--contexts", "64", "--batches", "1,2", "--new-tokens", "4",
                 "--rule", "positional"]) == 0
    out = capsys.readouterr().out
    assert "--rule positional" in out and "rule positional" in out
    assert main(["bench", str(mask_dir), "--contexts", "64", "--dense-until", "32", "--rule", "positional"]) == 2
    assert "no meaning under rule='positional'" in capsys.readouterr().err
    assert main(["generate", str(mask_dir), "--prompt", "w5", "--rule", "vllm"]) == 2
    assert "vllm" in capsys.readouterr().err

    seen = {}
    real = ev.evaluate

    def spy(lm, lengths, samples, *args, **kwargs):
        seen["rule"] = lm.rule
        return real(lm, [300], 1, *args, **{**kwargs, "tasks": ["passkey"]})

    monkeypatch.setattr(ev, "evaluate", spy)
    res = tmp_path / "r.json"
    assert main(["eval", str(mask_dir), "--quick", "--methods", "full", "leank", "--rule", "positional",
                 "--json", str(res)]) == 0
    assert seen == {"rule": "positional"}
    saved = __import__("json").loads(res.read_text())
    assert saved["rule"] == "positional" and "--rule positional" in saved["command"]


@pytest.mark.slow
def test_embedded_model_with_the_recommended_mask(embedded):
    """SmolLM2-135M with hub/smollm2-135m-instruct-s3 (sink 16, recent 64, accumu 16; zero heads): greedy
    generate under the positional rule equals the reference loop, and a chunked prefill equals one prefill."""
    from pathlib import Path

    model, tok = embedded
    mask = ChannelMask.from_pretrained(Path(__file__).resolve().parents[1] / "hub" / "smollm2-135m-instruct-s3")
    assert (mask.kept_counts == 0).any()
    lk = LeanKModel(model, mask, tok, rule="positional")
    rows = [tok(" ".join(f"The code word of item {i} is {i * 7919 % 10000}." for i in range(n))
                + " The code word of item 12 is")["input_ids"] for n in (40, 33)]
    width = len(rows[0])
    ids = torch.full((2, width), tok.eos_token_id, dtype=torch.long)
    attn = torch.zeros(2, width, dtype=torch.long)
    for r, row in enumerate(rows):  # row 1 left-padded
        ids[r, width - len(row):], attn[r, width - len(row):] = torch.tensor(row), 1
    new = 6
    kw = dict(max_new_tokens=new, min_new_tokens=new, **{**GREEDY, "pad_token_id": tok.eos_token_id})
    got = lk.generate(ids, attention_mask=attn, **kw)
    want_ids, want_logits = reference_greedy(model, mask, ids, attn, new)
    assert torch.equal(got.sequences, want_ids)
    for x, y in zip(got.logits, want_logits, strict=True):
        torch.testing.assert_close(x, y, atol=2e-4, rtol=1e-4)
    chunked = lk.generate(ids, attention_mask=attn, prefill_chunk_size=128, **kw)
    assert torch.equal(chunked.sequences, got.sequences)
    torch.testing.assert_close(torch.stack(chunked.logits), torch.stack(got.logits), atol=2e-4, rtol=1e-4)


def test_eval_masks_answers_under_both_rules_on_the_same_probes(tmp_path):
    """benchmarks/eval_masks.py --rules: each mask once per rule, the first rule's names unchanged, on one set of
    probes (paired with the same full-model answers)."""
    import json

    from conftest import load_benchmark
    from test_model import tiny_repo

    mask_dir, _ = tiny_repo(tmp_path, mask=random_mask(seed=1))
    out = tmp_path / "run.json"
    load_benchmark("eval_masks").main([str(mask_dir), "--lengths", "300", "--samples", "2", "--tasks", "passkey",
                                       "--threads", "1", "--seed", "0", "--no-baselines", "--rules", "dense-prompt",
                                       "positional", "--json", str(out)])
    run = json.loads(out.read_text())
    assert run["methods"] == ["full", "leank-r50", "leank-r50-positional"]
    assert all(set(row["correct"]) == set(run["methods"]) for row in run["answers"]) and len(run["answers"]) == 2
