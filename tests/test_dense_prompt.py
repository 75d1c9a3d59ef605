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
from test_positional import GREEDY, left_padded, positions

from leank_infer import LeanKModel
from leank_infer.decode.attention import dense_attention
from leank_infer.decode.cache import LeanKCache, fill_from_prefill
from leank_infer.decode.masked_attention import leank_attention

pytestmark = pytest.mark.usefixtures("one_thread")

REF = "leank_dense_prompt_ref"


def reference_greedy(model, mask, ids: torch.Tensor, attn: torch.Tensor, new: int):
    """Greedy decoding where every forward is the whole sequence so far: queries of the prompt (padded index below
    its width) by the model's dense attention, the others by the positional rule. (sequences, last logits)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    starts = (attn == 0).long().cumprod(-1).sum(-1)
    width = ids.shape[1]

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
        n, k = query.shape[2], key.shape[2]
        dense = dense_attention(module, query, key, value, attention_mask, scaling, softcap)[0]
        out = leank_attention(query, key, value, mask.keep[module.layer_idx].float(), torch.arange(k - n, k),
                              mask.sink_size, mask.recent_size, scaling, key_start=starts, skip_zero_heads=True,
                              softcap=softcap, accumu_size=mask.accumu_size)
        in_prompt = torch.arange(k - n, k) < width
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
    want_ids, want_logits = reference_greedy(model, mask, ids, attn, new)
    for step, (x, y) in enumerate(zip(got.logits, want_logits, strict=True)):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4, msg=f"step {step}")
    assert torch.equal(got.sequences, want_ids)
    with torch.no_grad():
        full = model(ids, attention_mask=attn, position_ids=positions(attn)).logits[:, -1]
    torch.testing.assert_close(got.logits[0], full, atol=2e-5, rtol=1e-4)
    for rule in ("dense-prefill", "positional"):
        other = LeanKModel(model, mask, rule=rule).generate(ids, attention_mask=attn, **kw)
        assert not torch.allclose(torch.stack(other.logits), torch.stack(got.logits), atol=1e-4), rule


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


def test_dense_until_is_refused():
    mask = random_mask()
    with pytest.raises(ValueError, match="dense_until=64 has no meaning under rule='dense-prompt'"):
        LeanKCache(mask, dense_until=64, rule="dense-prompt")
