"""Speculative decoding (vLLM's n-gram drafts) with LeanK: a request's drafts are several generated queries in one
step, and each is scored under the rule at its own position, in the batched decode (one row per query).

Greedy output with speculation must equal greedy output without it, which ``LeanKModel.generate`` gives (the other
tests hold vLLM without speculation to it), token for token; the drafts must be accepted now and then (else the
multi-query rows were never checked) and must have gone through the batched decode.
"""

from __future__ import annotations

import gc

import pytest

from .conftest import ENGINE, MASK, reference_tokens
from .test_vllm_plugin import prose, run

pytestmark = pytest.mark.slow

NEW_TOKENS = 40
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def test_ngram_speculation_gives_leank_models_greedy_tokens(model_dir, tokenizer, monkeypatch):
    from vllm import LLM

    from leank_infer.vllm import stores

    seen = []  # the steps whose batched decode took several queries of one request
    multi_rows = stores._multi_rows
    monkeypatch.setattr(stores, "_multi_rows", lambda *a: seen.append(len(a[1])) or multi_rows(*a))
    ask = tokenizer("\n\nRepeat the first paragraph above word for word.").input_ids
    doc = prose(tokenizer)
    prompts = [doc[1000 * i : 1000 * i + n] + ask for i, n in enumerate((300, 700, 1200))]
    llm = LLM(model=str(model_dir), additional_config={"leank_mask": MASK}, speculative_config=SPEC,
              enforce_eager=True, disable_log_stats=False, **ENGINE)  # fmt: skip
    try:
        outs = run(llm, prompts, NEW_TOKENS)
        metrics = {m.name: m for m in llm.get_metrics()}
    finally:
        del llm
        gc.collect()
    assert [list(o.outputs[0].token_ids) for o in outs] == reference_tokens(prompts, NEW_TOKENS)
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    assert accepted > 0, "no draft was accepted: the prompts no longer exercise speculation"
    assert seen, "the drafts never went through the batched decode"
