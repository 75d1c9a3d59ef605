"""Speculative decoding (vLLM's n-gram drafts) with LeanK: a request's drafts are several generated queries in one
step, and each is scored under the rule at its own position, in the batched decode (one row per query).

Greedy output with speculation must equal greedy output without it, which ``LeanKModel.generate`` gives (the other
tests hold vLLM without speculation to it), token for token; the drafts must be accepted now and then (else the
multi-query rows were never checked) and must have gone through the batched decode, as runs of the CPU kernel (a
request's queries reading the middle they share once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import EAGER, MASK, ROOT, reference_tokens
from .test_vllm_plugin import prose

pytestmark = pytest.mark.slow

NEW_TOKENS = 40
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

# The engine runs in a fresh process: vLLM's n-gram drafter imports numba (llvmlite), whose foreign-function object
# makes vLLM's scan of sys.modules for Triton kernels fail in any engine built later in the same process.
CHILD = r"""
import json, sys
from vllm import LLM, SamplingParams, TokensPrompt
from leank_infer.vllm import stores

job = json.load(sys.stdin)
seen = []  # steps whose batched decode took several queries of one request
multi_rows = stores._multi_rows
stores._multi_rows = lambda *a: seen.append(len(a[1])) or multi_rows(*a)
from leank_infer.vllm import cpu_decode
runs_seen = []  # runs of several queries the CPU kernel was handed
decode = cpu_decode.LayerKernel.decode
def counted(self, *a, **k):
    runs = a[5] if len(a) > 5 else k.get("runs")
    if runs is not None and int(runs.max()) > 1:
        runs_seen.append(1)
    return decode(self, *a, **k)
cpu_decode.LayerKernel.decode = counted
llm = LLM(model=job["model"], additional_config={"leank_mask": job["mask"]}, speculative_config=job["spec"],
          disable_log_stats=False, **job["engine"])
params = SamplingParams(temperature=0.0, max_tokens=job["new"], ignore_eos=True)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
accepted = [m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens"]
print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "accepted": accepted[0],
                              "seen": len(seen), "runs": len(runs_seen)}), flush=True)
"""


def test_ngram_speculation_gives_leank_models_greedy_tokens(model_dir, tokenizer):
    ask = tokenizer("\n\nRepeat the first paragraph above word for word.").input_ids
    doc = prose(tokenizer)
    prompts = [doc[1000 * i : 1000 * i + n] + ask for i, n in enumerate((300, 700, 1200))]
    job = {"model": str(model_dir), "mask": MASK, "spec": SPEC, "engine": EAGER, "new": NEW_TOKENS, "prompts": prompts}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(job), capture_output=True, text=True,
                         env=env, timeout=900)  # fmt: skip
    lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    got = json.loads(lines[-1][7:])
    assert got["tokens"] == reference_tokens(prompts, NEW_TOKENS)
    assert got["accepted"] > 0, "no draft was accepted: the prompts no longer exercise speculation"
    assert got["seen"], "the drafts never went through the batched decode"
    assert got["runs"], "the drafts never reached the CPU kernel as runs"


def test_draft_rows_count_their_keys_from_the_exact_lengths():
    """Each query of a few-query request sees its request's keys up to its own position, counted from the exact
    ``seq_lens`` (vLLM's host upper bound assumes every draft of an asynchronous speculative step was accepted)."""
    import torch

    from leank_infer.vllm.stores import _multi_rows

    seq_lens = torch.tensor([50, 70, 90, 120], dtype=torch.int32)  # exact, after the step
    # two one-token decodes, then request 2 with queries [2, 5) and request 3 with [5, 7) (no prompt query: split at
    # the first); the extends' ``cached`` (field 4) is the host's optimistic count and must not be used
    few = [(2, 2, 2, 5, 999), (3, 5, 5, 7, 999)]
    tokens, rows, keys, runs = _multi_rows(2, few, seq_lens)
    assert tokens.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert rows.tolist() == [0, 1, 2, 2, 2, 3, 3]
    assert keys.tolist() == [50, 70, 88, 89, 90, 119, 120]
    # each request's queries are one run for the CPU kernel (it reads the middle they share once)
    assert runs.tolist() == [1, 1, 3, 0, 0, 2, 0] and runs.dtype == torch.int32 and runs.device.type == "cpu"
