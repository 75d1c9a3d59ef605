"""A prefix-cache hit that leaves one prompt token: vLLM schedules that token as a decode (one new token), but
under the default dense-prompt rule it is a prompt query, which attends to the prompt with every channel.

Found by the soak test (tests/vllm_plugin/test_vllm_soak.py): a 609-token prompt (609 = 38 blocks of 16 + 1, the
block sizes then) sent again after it was computed hit 608 tokens (vLLM hits a prefix at a multiple of every KV cache group's block size:
the packed pages' and the window pages'), its last prompt token ran LeanK's decode attention, and its greedy
tokens left LeanKModel's from the tenth on. Its own engine (enforce_eager: nothing to compile), one prompt.
"""

from __future__ import annotations

import gc
import math

import pytest

from .conftest import EAGER, MASK, reference_tokens
from .test_vllm_plugin import leank_impls, prose, run

pytestmark = pytest.mark.slow

NEW_TOKENS = 16


def test_a_hit_that_leaves_the_last_prompt_token_equals_leank_model(model_dir, tokenizer):
    from vllm import LLM

    llm = LLM(model=str(model_dir), additional_config={"leank_mask": MASK}, **EAGER)
    try:
        plan = leank_impls(llm)[0].plan  # the engine's block sizes
        block = math.lcm(plan.block_size, plan.window_block)  # vLLM hits prefixes at multiples of every group's block
        ask = tokenizer("\n\nWhat is the first topic above?").input_ids
        doc = prose(tokenizer)[4000:]
        prompt = doc[: 600 - (600 + len(ask) - 1) % block] + ask  # one token past whole blocks
        assert len(prompt) % block == 1
        first = run(llm, [prompt], NEW_TOKENS)[0]  # computes the prompt, caches its blocks
        again = run(llm, [prompt], NEW_TOKENS)[0]
        assert again.num_cached_tokens == len(prompt) - 1, "the repeat no longer leaves one token to compute"
        want = reference_tokens([prompt], NEW_TOKENS)[0]
        assert list(first.outputs[0].token_ids) == want
        assert list(again.outputs[0].token_ids) == want
    finally:
        del llm
        gc.collect()
