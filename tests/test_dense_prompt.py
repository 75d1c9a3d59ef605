"""rule="dense-prompt" on the HF path: the prompt attends with every channel, each generated token by its position.

It is what the vLLM plugin serves by default: the prompt's forward is the model's dense one (its first token is
the full model's), and every later query follows ``positional_recent_from`` (the reference: a whole forward of the
sequence so far per generated token, prompt queries dense, later ones by ``leank_attention(accumu_size=A)``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_model import prompt, random_mask
from test_positional import GREEDY, left_padded, positions, reference_greedy

from leank_infer import LeanKModel
from leank_infer.decode.cache import LeanKCache, fill_from_prefill

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_generate_equals_the_reference_loop(family):
    """A left-padded batch, greedy: the tokens and logits of the reference loop; the first logits are the dense
    model's, and the later ones differ from both other rules (so the test can tell them apart)."""
    model = tiny_model(family)
    mask = random_mask(seed=1)
    ids, attn = left_padded([30, 21, 26])
    new = 24
    kw = dict(max_new_tokens=new, min_new_tokens=new, **GREEDY)
    got = LeanKModel(model, mask, rule="dense-prompt").generate(ids, attention_mask=attn, **kw)
    want_ids, want_logits = reference_greedy(model, mask, ids, attn, new, dense_prompt=True)
    for step, (x, y) in enumerate(zip(got.logits, want_logits, strict=True)):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4, msg=f"step {step}")
    assert torch.equal(got.sequences, want_ids)
    with torch.no_grad():
        full = model(ids, attention_mask=attn, position_ids=positions(attn)).logits[:, -1]
    torch.testing.assert_close(got.logits[0], full, atol=2e-5, rtol=1e-4)
    other = LeanKModel(model, mask, rule="positional").generate(ids, attention_mask=attn, **kw)
    assert not torch.allclose(torch.stack(other.logits), torch.stack(got.logits), atol=1e-4)
    default = LeanKModel(model, mask).generate(ids, attention_mask=attn, **kw)  # the default rule is this one
    assert torch.equal(default.sequences, got.sequences)


def test_a_dense_prefill_fills_it_as_its_own_prefill_does():
    """Its prompt attends densely, so one dense prefill's K/V fill the cache exactly as its own prefill does
    (the evaluation and the benchmark share that prefill), and the next token decodes the same from both."""
    model = tiny_model("llama")
    mask = random_mask(seed=1)
    lk = LeanKModel(model, mask, rule="dense-prompt")
    ids = prompt(90, seed=4)
    own = lk.new_cache()
    with torch.no_grad():
        lk(ids, cache=own)
        with lk.dense():
            from transformers import DynamicCache

            dense = DynamicCache(config=model.config)
            lk(ids, cache=dense)
    filled = fill_from_prefill(LeanKCache(mask, config=model.config, rule="dense-prompt"),
                               [layer.keys for layer in dense.layers], [layer.values for layer in dense.layers])
    for x, y in zip(own.layers, filled.layers, strict=True):
        assert (x.head_len, x.mid_len, x.tail_len) == (y.head_len, y.mid_len, y.tail_len)
        assert x.mid_len > 0
    nxt = torch.tensor([[5]])
    with torch.no_grad():
        a = lk(nxt, cache=own).logits
        b = lk(nxt, cache=filled).logits
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_dense_until_works_under_it():
    """dense_until is the default rule's short-context switch (tests/test_cache.py follows it step by step); the
    positional rule, whose prompt is pruned too, refuses it."""
    mask = random_mask()
    assert LeanKCache(mask, dense_until=64, rule="dense-prompt").layers[0].dense_until == 64
    with pytest.raises(ValueError, match="dense_until=64 has no meaning under rule='positional'"):
        LeanKCache(mask, dense_until=64, rule="positional")


def test_the_evaluation_answers_by_it_from_its_shared_dense_prefill(tmp_path):
    """A method under the dense-prompt rule takes the evaluation's one dense prefill (its prompt attends densely)
    and decodes by its own rule: each row's answer is that prompt's own ``generate`` under the rule."""
    from test_model import tiny_repo

    from leank_infer import ChannelMask
    from leank_train.evaluation.loop import answer_batch
    from leank_train.evaluation.methods import Learned

    scores = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(1))
    mask = ChannelMask.from_scores(scores, 0.75, 4, sink_size=4, recent_size=8, accumu_size=4)
    mask_dir, _ = tiny_repo(tmp_path, family="qwen3", mask=mask)
    lm = LeanKModel.from_pretrained(mask_dir, rule="positional")  # the method's own rule must win over the model's
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (64, 41, 57)]
    got = answer_batch(lm, [Learned(), Learned("leank-dp", rule="dense-prompt")], prompts, [16, 16, 16])
    rule = LeanKModel(lm.model, lm.mask, lm.tokenizer, rule="dense-prompt")
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        out = rule.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        assert got["leank-dp"][i] == lm.tokenizer.decode(out[0, len(p):], skip_special_tokens=True), i
    assert got["leank-dp"] != got["leank"], "the rules should answer differently here (else the test cannot tell)"
