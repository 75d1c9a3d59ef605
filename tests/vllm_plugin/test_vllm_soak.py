"""The OpenAI server with a LeanK mask held under load and faults, on loopback, bounded in time.

One server (vLLM's defaults, 1 GiB of KV, its development endpoints on): concurrent requests over shared document
prefixes while streaming requests are dropped mid-stream and every running request is preempted (vLLM's own
``POST /reset_prefix_cache?reset_running_requests=true``: blocks freed, requests recomputed later); then the same
requests one at a time give the same greedy tokens; bad requests get a 400 and the server keeps answering; and the
KV blocks in use (``vllm:kv_cache_usage_perc`` of ``/metrics``) return to zero when idle. Sized for a 2-core
machine shared with other work: 8 requests of about 300-730 prompt tokens, 3 dropped streams, 2 preemption waves. Every request has a
client timeout (:data:`REQUEST_S`): a server that stops scheduling fails the test instead of hanging it.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import reference_tokens
from .openai_server import openai_server
from .test_vllm_plugin import prose

pytestmark = pytest.mark.slow

DOCS = (290, 450, 600, 720)  # shared prefixes, two questions each: 8 requests
ASKS = ("\n\nWhat is the first topic above?", "\n\nName one keyword used above.")
NEW_TOKENS = 16
DROPPED = 3  # streaming requests closed after their first tokens
IDLE_S = 15  # how long the KV usage may take to return to zero
REQUEST_S = 600  # one request's limit: a server that stops scheduling fails here (the load takes minutes at most)
PREEMPT_WAVES = 2


def metric(url: str, name: str) -> float:
    """A gauge or counter of the server's ``/metrics``, summed over its labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert values, f"{name} is not among the server's metrics"
    return sum(float(v) for v in values)


def wait_idle(url: str) -> float:
    """Seconds until vLLM's KV usage is zero (fails after :data:`IDLE_S`)."""
    start = time.monotonic()
    while (usage := metric(url, "vllm:kv_cache_usage_perc")) != 0:
        assert time.monotonic() - start < IDLE_S, f"KV usage still {usage} after {IDLE_S} s idle"
        time.sleep(0.5)
    return time.monotonic() - start


def test_concurrent_dropped_and_preempted_requests_answer_as_one_at_a_time(model_dir, tokenizer, tmp_path):
    ids = prose(tokenizer)
    prompts = [ids[2000 * d : 2000 * d + n] + tokenizer(ask).input_ids for d, n in enumerate(DOCS) for ask in ASKS]
    reference = reference_tokens(prompts, NEW_TOKENS)  # LeanKModel.generate, each prompt alone
    with openai_server(model_dir, tmp_path / "serve.log", "--max-model-len", "2048", "--max-num-seqs", "16",
                       "--enforce-eager", dev=True) as url:
        soak(url, prompts, ids, reference)


def soak(url: str, prompts: list[list[int]], ids: list[int], reference: list[list[int]]) -> dict[str, float]:
    """The load, the faults and the checks against the server at ``url``; what it measured. ``reference``: each
    prompt's greedy tokens from LeanKModel.generate (what both the loaded and the idle server must give)."""
    import openai

    seen: dict[str, float] = {}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_S)

    def complete(prompt: list[int]) -> list[int]:
        out = client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        return list(out.choices[0].token_ids)

    def dropped(prompt: list[int]) -> int:
        stream = client.completions.create(model="smollm2", prompt=prompt, max_tokens=400, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
        got = 0
        for _ in stream:
            got += 1
            if got == 3:
                break
        stream.close()  # the connection goes: vLLM aborts the request
        return got

    done = threading.Event()

    def preempt() -> None:  # every running request back to the waiting queue, its blocks freed, PREEMPT_WAVES times
        for _ in range(PREEMPT_WAVES):  # each wave once requests run (the load may take only seconds)
            while metric(url, "vllm:num_requests_running") == 0:
                if done.is_set():
                    return
                time.sleep(0.05)
            request = urllib.request.Request(f"{url}/reset_prefix_cache?reset_running_requests=true", method="POST")
            urllib.request.urlopen(request, timeout=60).close()
            time.sleep(0.5)  # the preempted requests resume before the next wave

    with ThreadPoolExecutor(len(prompts) + DROPPED + 1) as pool:
        drops = [pool.submit(dropped, prompts[(5 * i) % len(prompts)][: 200 + 150 * i]) for i in range(DROPPED)]
        waves = pool.submit(preempt)
        together = list(pool.map(complete, prompts))
        done.set()
        assert [d.result() for d in drops] == [3] * DROPPED
        waves.result()
    seen["preemptions"] = metric(url, "vllm:num_preemptions_total")
    assert seen["preemptions"] > 0, "no request was preempted: the test no longer tests preemption"
    seen["idle_after_load_s"] = wait_idle(url)

    wrong = [i for i, (got, want) in enumerate(zip(together, reference, strict=True)) if got != want]
    assert not wrong, f"served together, requests {wrong} differ from LeanKModel: {[together[i] for i in wrong]}"
    alone = [complete(p) for p in prompts]

    with pytest.raises(openai.BadRequestError):  # longer than --max-model-len
        complete(ids[:2100])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2", prompt=prompts[0], max_tokens=4, temperature=-1.0)
    assert complete(prompts[3]) == alone[3]
    seen["idle_at_end_s"] = wait_idle(url)
    wrong = [i for i, (got, want) in enumerate(zip(alone, reference, strict=True)) if got != want]
    assert not wrong, (f"served one at a time after the load (prefix-cache hits), requests {wrong} differ from "
                       f"LeanKModel: {[alone[i] for i in wrong]} vs {[reference[i] for i in wrong]}")
    return seen
