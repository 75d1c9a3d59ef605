"""vLLM's OpenAI server with a LeanK mask as a user runs it (vLLM's default flags): localhost, the openai client."""

from __future__ import annotations

import re

import pytest

from .conftest import plain_kv_tokens, reference_tokens
from .openai_server import openai_server
from .test_vllm_plugin import NEW_TOKENS, prompts  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow
@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # otherwise vLLM's defaults: prefix caching, chunked prefill, its compilation
    with openai_server(model_dir, log, "--max-model-len", "4096", "--max-num-seqs", "8") as url:
        yield f"{url}/v1", log


def test_server_answers_like_leank_model_and_holds_more_tokens(server, prompts, tokenizer):  # noqa: F811
    from openai import OpenAI

    base_url, log = server
    client = OpenAI(base_url=base_url, api_key="unused")
    # the completions API takes token ids: the same input as the reference
    got = client.completions.create(
        model="smollm2",
        prompt=prompts[1],
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},  # vLLM's own request fields
    )
    want = reference_tokens(prompts, NEW_TOKENS)[1]
    assert got.choices[0].token_ids == want
    assert got.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16,
        temperature=0.0,
    )  # fmt: skip
    assert "Paris" in chat.choices[0].message.content
    size = re.search(r"KV cache size: ([\d,]+) tokens", log.read_text())
    assert size, "the server did not report its KV cache size"
    assert int(size.group(1).replace(",", "")) >= 1.8 * plain_kv_tokens()
