"""Tensor parallelism: three CPU ranks, one KV head each, every rank its heads' slice of the mask."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import EAGER, MASK, reference_tokens
from .test_vllm_plugin import NEW_TOKENS, prompts  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

CHILD = """
import json, sys
from vllm import LLM, SamplingParams, TokensPrompt
job = json.loads(sys.stdin.read())
llm = LLM(model=job["model"], additional_config={"leank_mask": job["mask"]}, tensor_parallel_size=3,
          **job["engine"])
params = SamplingParams(temperature=0.0, max_tokens=job["n"], ignore_eos=True)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
"""


def test_tensor_parallel_3_equals_leank_model(model_dir, prompts):  # noqa: F811
    """TP=3 (vLLM's CPU build, its own worker processes) gives LeanKModel(rule="dense-prompt")'s tokens.

    Eager: three workers compiling the model on a 2-core test machine cost minutes and test nothing of LeanK's."""
    job = {"model": str(model_dir), "mask": MASK, "prompts": prompts[:2], "n": NEW_TOKENS, "engine": EAGER}
    # vLLM-CPU binds each rank's OpenMP threads to its own NUMA node unless told not to; this machine
    # (like most test runners) has one node, so the ranks share the cores.
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    run = subprocess.run(
        [sys.executable, "-c", CHILD], input=json.dumps(job), capture_output=True, text=True, env=env, timeout=1800
    )
    lines = [x for x in run.stdout.splitlines() if x.startswith("TOKENS ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    assert json.loads(lines[-1][len("TOKENS ") :]) == reference_tokens(prompts[:2], NEW_TOKENS)
