"""The vLLM tests: skipped unless vLLM imports (they run in the vLLM environment, `make test-vllm`).

They serve the embedded SmolLM2 from the de-quantised copy that the main environment writes to
``~/.cache/leank`` (``$LEANK_EMBEDDED_DIR`` names it; `make test-vllm` sets it) with vLLM offline,
and take their reference generations from the main environment (``$LEANK_REF_PYTHON``, default
``.venv/bin/python``), where ``LeanKModel.generate`` runs on a transformers that vLLM does not allow.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed here (make test-vllm runs these tests in .venv-vllm)"
)

ROOT = Path(__file__).resolve().parents[2]
MASK = str(ROOT / "hub" / "smollm2-135m-instruct-s3")  # the recommended 0.7 mask (whole heads)
# One engine shape for every test: fp32 like the HF reference, 1 GiB of KV, and otherwise vLLM's defaults
# (prefix caching and chunked prefill on): naming a mask is the only change (EAGER below: not compiling either).
KV_SPACE_GIB = 1
ENGINE = dict(dtype="float32", max_model_len=4096, max_num_seqs=8)
# The same engine without vLLM's torch.compile, for tests whose subject is the plugin's scheduling (chunks,
# preemption) or arithmetic (fp8, an all-ones mask): compiling the model takes 50-80 s of each engine's start on
# two cores, and the compiled path, which calls the same attention, is what `leank_llm`, one chunked case
# (test_vllm_plugin.py) and the server run.
EAGER = {**ENGINE, "enforce_eager": True}

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_SPACE_GIB))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Keep the engine in this process: tests read its KV capacity and the backend's state directly.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def embedded_dir() -> Path:
    """The de-quantised embedded model folder (skip when the main environment has not written it)."""
    named = os.environ.get("LEANK_EMBEDDED_DIR")
    if named:
        return Path(named)
    found = sorted(Path.home().joinpath(".cache", "leank").glob("SmolLM2-135M-Instruct*/model.safetensors"))
    if not found:
        pytest.skip("no de-quantised embedded model in ~/.cache/leank (run `make test-vllm`)")
    return found[-1].parent


def reference_tokens(
    prompts: list[list[int]], max_new_tokens: int, mask: str = MASK, rule: str = "dense-prompt"
) -> list[list[int]]:
    """``LeanKModel(rule=rule).generate`` greedy tokens, each prompt alone, from the main environment (the
    plugin's default rule unless named)."""
    python = os.environ.get("LEANK_REF_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    if not Path(python).exists():
        pytest.skip(f"no main environment at {python} for the LeanKModel reference (set LEANK_REF_PYTHON)")
    job = {"model": str(embedded_dir()), "mask": mask, "prompts": prompts, "max_new_tokens": max_new_tokens,
           "rule": rule}
    key = json.dumps(job)
    if key in _REFERENCE:
        return _REFERENCE[key]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [python, str(ROOT / "tests" / "vllm_plugin" / "reference.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if run.returncode != 0:
        raise AssertionError(f"reference run failed:\n{run.stderr[-3000:]}")
    _REFERENCE[key] = json.loads(run.stdout.strip().splitlines()[-1])["tokens"]
    return _REFERENCE[key]


_REFERENCE: dict[str, list[list[int]]] = {}  # one reference run per job and session


def plain_kv_tokens(block_size: int = 128, element_bytes: int = 4) -> int:
    """Tokens plain vLLM fits in the KV space for the embedded model (its own formula, in whole blocks).

    ``element_bytes``: 4 for fp32 KV, 1 for fp8."""
    dense = 2 * 30 * 3 * 64 * element_bytes  # K+V, 30 layers, 3 KV heads, head_dim 64
    return (KV_SPACE_GIB * 2**30 // (dense * block_size)) * block_size


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return embedded_dir()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def leank_llm(model_dir):
    """One LeanK engine per test module, stats on (preemptions, hits).

    Per module, not per session: deleting any in-process engine tears down vLLM's process-wide parallel
    state (``EngineCore.shutdown`` calls ``cleanup_dist_env_and_memory``), so an engine cannot outlive
    another module's engines."""
    yield from _module_engine(model_dir, ENGINE)


@pytest.fixture(scope="module")
def leank_eager_llm(model_dir):
    """:func:`leank_llm` without torch.compile (:data:`EAGER`)."""
    yield from _module_engine(model_dir, EAGER)


def _module_engine(model_dir: Path, engine: dict):
    """A LeanK engine with ``engine``'s arguments, stats on, deleted when its module is done."""
    from vllm import LLM

    llm = LLM(model=str(model_dir), additional_config={"leank_mask": MASK}, disable_log_stats=False, **engine)
    yield llm
    del llm
    gc.collect()
