"""`leank eval` scores what it claims: right and wrong answers, each method with its own mask, the KL."""

from __future__ import annotations

import pytest
import torch
from test_model import tiny_repo

from leank_infer import ChannelMask, LeanKModel
from leank_train.evaluate import (
    RetrievalEval,
    answer_with,
    evaluate,
    next_token_kl,
    random_mask_like,
    score_answer,
    think_mask,
)

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = [" ".join(f"w{3 + (7 * i + j) % 120}" for j in range(9)) + "." for i in range(60)]


def test_score_answer_on_answers_known_right_and_wrong():
    assert score_answer("The passcode is 4711.", ["4711"]) == 1.0
    assert score_answer("4711", ["4711"]) == 1.0
    assert score_answer("The passcode is 4712.", ["4711"]) == 0.0
    assert score_answer("", ["4711"]) == 0.0
    assert score_answer("12345, 67890 and 13579", ["12345", "67890", "13579"]) == 1.0
    assert score_answer("12345 and 67890", ["12345", "67890", "13579"]) == 0.0  # every value is needed


def _decode(lm, mask, inputs, n):
    """Greedy answer of the model itself (``mask`` None: dense on purpose) or of ``mask``."""
    gen = dict(max_new_tokens=n, do_sample=False)
    if mask is None:
        with lm.dense():
            out = lm.model.generate(**inputs, **gen)
    else:
        out = LeanKModel(lm.model, mask, lm.tokenizer).generate(**inputs, **gen)
    tokenizer = lm.tokenizer
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_each_method_decodes_with_its_own_mask(tmp_path):
    """full: the model itself; leank: the learned mask; random/think: their own masks at the same budget.
    The four answers differ on this prompt, so a method routed through another's mask is caught."""
    scores = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(1))
    mask = ChannelMask.from_scores(scores, 0.75, 4, sink_size=4, recent_size=8, accumu_size=4)
    mask_dir, _ = tiny_repo(tmp_path, family="qwen3", mask=mask)
    lm = LeanKModel.from_pretrained(mask_dir)
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    rnd = random_mask_like(lm.mask, seed=7)
    own = {"full": None, "leank": lm.mask, "random": rnd, "think": think_mask(lm.model, ids, lm.mask)}
    want = {m: _decode(lm, mask, inputs, 16) for m, mask in own.items()}
    assert len(set(want.values())) == 4, want  # the test can tell the methods apart
    for method in own:
        assert answer_with(lm, method, dict(inputs), 16, random_mask=rnd) == want[method], method
    with pytest.raises(ValueError, match="unknown method"):
        answer_with(lm, "dense", inputs)


def test_next_token_kl_is_zero_for_identical_models_and_positive_for_a_pruned_one(tmp_path):
    mask_dir, _ = tiny_repo(tmp_path)
    lm = LeanKModel.from_pretrained(mask_dir)
    full = LeanKModel(lm.model, ChannelMask.full(2, 2, 16, sink_size=4, recent_size=8, accumu_size=4), lm.tokenizer)
    kw = dict(context=48, steps=12, windows=2)
    assert next_token_kl(full, WORDS, **kw) == pytest.approx(0.0, abs=1e-6)
    pruned = next_token_kl(lm, WORDS, **kw)
    assert pruned > 1e-4
    # KL(full || LeanK) by hand for the first window: dense logits of the whole window vs LeanK's decode steps
    ids = lm.tokenizer(" ".join(WORDS[len(WORDS) // 2:]), return_tensors="pt")["input_ids"][:, :60]
    with torch.no_grad():
        p = torch.log_softmax(lm.model(ids).logits[0, 47:59].float(), -1)
        cache = lm.new_cache()
        rows = [lm(ids[:, :48], cache=cache).logits[0, -1]]
        rows += [lm(ids[:, t:t + 1], cache=cache).logits[0, -1] for t in range(48, 59)]
        q = torch.log_softmax(torch.stack(rows).float(), -1)
    first = float((p.exp() * (p - q)).sum(-1).mean())
    # the reference runs the window in one dense forward, next_token_kl decodes it step by step: fp32 sums in
    # another order move a KL of ~3e-4 by ~1e-4 of itself (seen in CI), a wrong window or step by far more
    assert next_token_kl(lm, WORDS, context=48, steps=12, windows=1) == pytest.approx(first, rel=2e-3)


def test_retrieval_eval_scores_each_answer_per_method_and_length(tmp_path, monkeypatch):
    """The evaluation loop scores the answer each method gave, on its own probe, into its own (method, length)
    cell, with the probe's generation budget (else the default), every batch answered by the same methods."""
    from leank_train.evaluation import loop
    from leank_train.evaluation.tasks import Probe

    mask_dir, _ = tiny_repo(tmp_path)
    lm = LeanKModel.from_pretrained(mask_dir)
    calls = []

    def fake_answer_batch(lm_, methods, prompts, max_new_tokens):
        calls.append(([m.name for m in methods], list(max_new_tokens), [len(p) for p in prompts], methods))
        # full answers every probe right; leank only the first of each length, in upper case
        return {"full": ["it is w7 w9"] * len(prompts),
                "leank": ["IT IS W7 W9" if p[0] == 5 else "w7" for p in prompts]}

    monkeypatch.setattr(loop, "answer_batch", fake_answer_batch)
    module = RetrievalEval(lm, ["full", "leank"], [100, 200], max_new_tokens=9)
    probes = [Probe([{"role": "user", "content": f"w{first} w4"}], ["w7", "w9"], "passkey", n, max_new_tokens=budget)
              for n in (100, 200) for first, budget in ((5, None), (6, 3))]
    # each batch mixes both lengths: every answer must land in its own probe's length cell
    for i, batch in enumerate(([probes[0], probes[2]], [probes[1], probes[3]])):
        module.test_step(batch, i)
    assert module.results() == {"full": {100: 1.0, 200: 1.0}, "leank": {100: 0.5, 200: 0.5}}
    assert [r["correct"] for r in module.answers[1:3]] == [{"full": True, "leank": True}, {"full": True, "leank": False}]
    assert module.answers[2]["leank"] == "w7" and [r["length"] for r in module.answers] == [100, 200, 100, 200]
    assert [c[1] for c in calls] == [[9, 9], [3, 3]]  # the probe's budget, else the evaluation's
    assert all(c[0] == ["full", "leank"] and c[3] is module.methods for c in calls)
    assert [c[2] for c in calls] == [[3, 3]] * 2  # "w5 w4" + the template's w3: the probe's own prompt


@pytest.mark.slow
def test_evaluate_scores_right_answers_and_a_mask_that_breaks_retrieval(embedded):
    """The embedded model finds the passkey; a mask that keeps no middle channel (the needle is in the
    middle) cannot: accuracy 1 for the full model, 0 for LeanK with that mask, every answer scored."""
    model, tok = embedded
    blind = ChannelMask(keep=torch.zeros(30, 3, 64, dtype=torch.bool), sink_size=4, recent_size=16,
                        accumu_size=8, ratio=0.9, align=16)
    res = evaluate(LeanKModel(model, blind, tok), lengths=[320], samples=2, kinds=["passkey"],
                   methods=["full", "leank"], seed=3, kl=False, max_new_tokens=24)
    for row in res["answers"]:
        assert row["expected"][0] in row["full"] and row["expected"][0] not in row["leank"], row
    assert res["accuracy"] == {"full": {320: 1.0}, "leank": {320: 0.0}}


def test_a_batch_answers_as_each_prompt_alone(tmp_path):
    """One shared dense prefill of a left-padded batch, then each method decodes the batch: every row's answer is
    that prompt's own answer (each method alone, no padding), so batching and sharing the prefill change nothing."""
    from leank_train.evaluation.loop import answer_batch
    from leank_train.evaluation.methods import Full, Learned, RandomChannels, ThinK

    scores = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(1))
    mask = ChannelMask.from_scores(scores, 0.75, 4, sink_size=4, recent_size=8, accumu_size=4)
    mask_dir, _ = tiny_repo(tmp_path, family="qwen3", mask=mask)
    lm = LeanKModel.from_pretrained(mask_dir)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (64, 41, 57)]
    methods = [Full(), Learned(), RandomChannels(seed=7), ThinK()]
    got = answer_batch(lm, methods, prompts, [16, 16, 9])
    rnd = random_mask_like(lm.mask, seed=7)
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        own = {"full": None, "leank": lm.mask, "random": rnd, "think": think_mask(lm.model, ids, lm.mask)}
        for name, m in own.items():
            want = _decode(lm, m, inputs, 9 if i == 2 else 16)
            assert got[name][i] == want, (name, i)


def test_retrieval_eval_rows_record_the_probe_and_its_own_prompt(tmp_path, monkeypatch):
    """Each answer row names its probe (kind, length, prompt tokens, haystack, index, expected) next to each
    method's text and verdict; the prompt is the probe's chat with its answer prefix opening the assistant turn,
    answered by the evaluation's own model. A method given as an object keeps its name, an underscore included."""
    from leank_train.evaluation import loop
    from leank_train.evaluation.methods import Learned
    from leank_train.evaluation.tasks import Probe, chat_ids

    mask_dir, _ = tiny_repo(tmp_path)
    lm = LeanKModel.from_pretrained(mask_dir)
    seen = []

    def fake_answer_batch(lm_, methods, prompts, max_new_tokens):
        seen.append((lm_, prompts))
        return {"full": ["w7"] * len(prompts), "leank_r80": ["w8"] * len(prompts)}

    monkeypatch.setattr(loop, "answer_batch", fake_answer_batch)
    second = Learned("leank_r80", lm.mask)
    module = RetrievalEval(lm, ["full", second], [100])
    assert module.methods[1] is second
    messages = [{"role": "user", "content": "w5 w4"}]
    probe = Probe(messages, ["w7"], "niah_single_word", 100, answer_prefix="w9 w6", haystack="essay", index=3)
    module.test_step([probe], 0)
    prompt = chat_ids(lm.tokenizer, messages, "w9 w6")
    assert prompt != chat_ids(lm.tokenizer, messages) and seen == [(lm, [prompt])]
    assert module.answers == [{"kind": "niah_single_word", "length": 100, "tokens": len(prompt), "haystack": "essay",
                               "index": 3, "expected": ["w7"], "full": "w7", "leank_r80": "w8",
                               "correct": {"full": True, "leank_r80": False}}]
    assert module.results() == {"full": {100: 1.0}, "leank_r80": {100: 0.0}}
    with pytest.raises(ValueError, match="share a name: \\['leank', 'leank'\\]"):
        RetrievalEval(lm, ["leank", Learned()], [100])


def test_one_default_generation_budget(tmp_path, monkeypatch):
    """answer_with and RetrievalEval answer with evaluate's default budget when none is given."""
    import inspect

    from leank_train.evaluation import loop

    budget = inspect.signature(evaluate).parameters["max_new_tokens"].default
    mask_dir, _ = tiny_repo(tmp_path)
    lm = LeanKModel.from_pretrained(mask_dir)
    asked = []
    monkeypatch.setattr(loop, "answer_batch", lambda lm_, methods, prompts, max_new_tokens:
                        asked.append(list(max_new_tokens)) or {m.name: [""] for m in methods})
    answer_with(lm, "full", {"input_ids": torch.tensor([[5, 6, 7]])})
    assert asked == [[budget]]
    assert RetrievalEval(lm, ["full"], [100]).max_new_tokens == budget


def test_a_batch_answers_without_a_pad_token(tmp_path):
    """A tokenizer without a pad token (Llama's) still batches: the left padding is id 0, never attended."""
    from leank_train.evaluation.loop import answer_batch
    from leank_train.evaluation.methods import Full

    mask_dir, _ = tiny_repo(tmp_path)
    lm = LeanKModel.from_pretrained(mask_dir)
    lm.tokenizer.pad_token = None
    assert lm.tokenizer.pad_token_id is None
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (30, 21)]
    got = answer_batch(lm, [Full()], prompts, [6, 6])["full"]
    for p, text in zip(prompts, got, strict=True):
        ids = torch.tensor([p])
        assert text == _decode(lm, None, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 6)


def test_random_mask_keeps_each_heads_count_and_is_the_random_methods_default():
    """random_mask_like keeps per head exactly the learned mask's count, at other channels, one draw per seed;
    the "random" method with its default seed decodes with random_mask_like's default draw."""
    from types import SimpleNamespace

    from leank_train.evaluation.methods import RandomChannels

    scores = torch.rand(3, 2, 16, generator=torch.Generator().manual_seed(8))
    mask = ChannelMask.from_scores(scores, 0.6, 4, sink_size=4, recent_size=8, accumu_size=4)
    assert len(set(mask.kept_counts.flatten().tolist())) > 1  # heads keep different counts
    rnd = random_mask_like(mask)
    assert torch.equal(rnd.kept_counts, mask.kept_counts) and not torch.equal(rnd.keep, mask.keep)
    assert mask.scores is not None and rnd.scores is None  # the learned scores do not describe a random draw
    assert torch.equal(random_mask_like(mask, seed=0).keep, rnd.keep)
    assert not torch.equal(random_mask_like(mask, seed=1).keep, rnd.keep)
    assert torch.equal(RandomChannels().mask(SimpleNamespace(mask=mask), None, 0).keep, rnd.keep)
