"""Issue 46, item 20 in vLLM: a bad LeanK setting or mask stops ``LLM(...)`` in the caller's process with leank's one
line (vLLM's engine subprocess would report it as "Engine core initialization failed" alone), a mask that prunes
nothing at the engine's max_model_len is refused by name, and a pool too small for one request of max_model_len under
the dense-prompt rule is an error at start, not requests that wait forever."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import EAGER, MASK, ROOT

# Each case in a fresh process with vLLM's engine subprocess on (V1 multiprocessing, vLLM's default): the tests'
# own process keeps its engines in-process (conftest), and vLLM caches its environment once an engine has run.
CALLER = r"""
import json, sys
from vllm import LLM

job = json.load(sys.stdin)
for case in job["cases"]:
    try:
        LLM(model=job["model"], additional_config=case["config"], **{**job["engine"], **case["engine"]})
        print(json.dumps({"error": None}), flush=True)
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
"""


def _masks(tmp_path) -> dict[str, str]:
    from leank_infer import ChannelMask

    mask = ChannelMask.from_pretrained(MASK)
    mask.sink_size = 2**31 - 1
    mask.save_pretrained(tmp_path / "sink")
    ChannelMask.full(2, 2, 16, base_model="tiny/other").save_pretrained(tmp_path / "other")
    return {
        "sink": str(tmp_path / "sink"),
        "other": str(tmp_path / "other"),
        "missing": str(tmp_path / "missing"),
    }


# (additional_config, engine arguments beyond conftest's EAGER, leank's line)
CASES = [
    ({"leank_mask": ""}, {}, "additional_config['leank_mask'] is '': give a mask folder or Hub repo id"),
    ({"leank-mask": MASK}, {}, "unknown LeanK setting(s) ['leank-mask'] in additional_config"),
    ({"leank_rule": "positional"}, {}, "additional_config sets ['leank_rule'] but no 'leank_mask'"),
    ({"leank_mask": MASK, "leank_rule": "dense"}, {}, "additional_config['leank_rule'] must be one of"),
    ({"leank_mask": "missing"}, {}, "is not a folder and not a Hub repo id (owner/name): no such folder"),
    ({"leank_mask": "other"}, {}, "num_layers is 2 in the mask but 30 in the model"),
    # item 20: a sink of 2**31 - 1 tokens used to get vLLM's memory message, naming no mask
    (
        {"leank_mask": "sink"},
        {},
        "its sink_size 2147483647, recent_size 64 and accumu_size 16 keep every channel of "
        "every token of a request up to max_model_len 4096 (LeanK prunes a token only in "
        "requests of at least 2147483712 tokens)",
    ),
    # an engine setting LeanK does not implement (checked in the worker before: a buried line too)
    (
        {"leank_mask": MASK},
        {"kv_cache_dtype": "turboquant_k8v4"},
        "LeanK serving does not support kv_cache_dtype='turboquant_k8v4'",
    ),
    # a draft model (the embedded model again, ``MODEL`` below): vLLM's own error was an assertion about cache groups
    (
        {"leank_mask": MASK},
        {"speculative_config": {"method": "draft_model", "model": "MODEL", "num_speculative_tokens": 3}},
        "LeanK serving does not support speculative decoding by 'draft_model': a drafter with attention layers",
    ),
    (
        {"leank_mask": MASK},
        {"max_model_len": 95},
        "keep every channel of every token of a request up to "
        "max_model_len 95 (LeanK prunes a token only in requests of at least "
        "96 tokens)",
    ),
]


def test_a_bad_leank_setting_reaches_the_caller_of_a_multiprocess_engine_as_leanks_line(model_dir, tmp_path):
    """``LLM(...)`` with vLLM's engine subprocess: each bad setting is a MaskError raised in the caller, its message
    leank's one line (before: RuntimeError "Engine core initialization failed", leank's line only in the log)."""
    masks = _masks(tmp_path)
    model = {"MODEL": str(model_dir)}
    cases = [{"config": {k: masks.get(v, v) for k, v in config.items()},
              "engine": {k: {a: model.get(b, b) for a, b in v.items()} if isinstance(v, dict) else v
                         for k, v in engine.items()}}
             for config, engine, _ in CASES]  # fmt: skip
    job = {"model": str(model_dir), "engine": EAGER, "cases": cases}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "PYTHONPATH": str(ROOT)}
    env.pop("LEANK_MASK", None)
    run = subprocess.run([sys.executable, "-c", CALLER], input=json.dumps(job), capture_output=True, text=True,
                         env=env, timeout=900)  # fmt: skip
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(CASES), run.stderr[-3000:]
    for (config, engine, message), got in zip(CASES, results, strict=True):
        assert got["error"] == "MaskError" and message in got["message"], (config, engine, got)
        assert "\n" not in got["message"], got


@pytest.mark.parametrize("max_model_len, pruned", [(95, False), (96, True), (4096, True)])
def test_a_mask_must_prune_some_token_at_max_model_len(max_model_len, pruned):
    """The bound of :func:`check_length` is the mask's own (``full_token_count``): the shortest request with a middle
    token is ``recent + (sink // accumu + 1) * accumu`` = 96 tokens for the embedded masks (16, 64, 16)."""
    from leank_infer import ChannelMask, MaskError
    from leank_infer.vllm.settings import check_length

    mask = ChannelMask.from_pretrained(MASK)
    assert bool(mask.full_token_count(max_model_len)[1]) == pruned
    if pruned:
        check_length(mask, max_model_len, "m")
    else:
        with pytest.raises(MaskError, match=r"LeanK mask 'm': its sink_size 16, .* at least 96 tokens"):
            check_length(mask, max_model_len, "m")


# ---- the pool: one request of max_model_len must fit (else vLLM admits none, ever, and says nothing) -------------
def _manager(num_blocks: int, dense_prompt: bool, window_stores: int = 2, max_model_len: int = 1536, window_block: int = 16):
    import torch
    from vllm.v1.core.block_pool import BlockPool

    from leank_infer.vllm.kv_specs import LeanKWindowManager, LeanKWindowSpec, register

    register()
    spec = LeanKWindowSpec(
        block_size=window_block, num_kv_heads=3, head_size=64, dtype=torch.float32, sliding_window=80, sink_len=16,
        dense_prompt=dense_prompt, window_stores=window_stores, max_model_len=max_model_len, packed_block_size=16,
    )  # fmt: skip
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=16)
    return LeanKWindowManager(
        spec, block_pool=pool, enable_caching=True, kv_cache_group_id=1, scheduler_block_size=16
    )


@pytest.mark.parametrize("dense_prompt, num_blocks, fits, window_block", [
    (True, 289, True, 16),  # 96 packed + 2 window stores x 96 prompt blocks = 288, plus vLLM's null block
    (True, 288, False, 16),
    (False, 96 + 2 * 13 + 1, True, 16),  # positional: a window store holds the sink and two windows, 13 blocks
    (False, 96 + 2 * 13, False, 16),
    (True, 96 + 2 * 171 + 1, True, 9),  # window blocks of 9 tokens: 1536 prompt tokens are 171 of them
    (True, 96 + 2 * 171, False, 9),
    (False, 96 + 2 * 22, False, 9),  # the sink (2 blocks of 9) and two windows of 80 (2 x (9 + 1))
])  # fmt: skip
def test_a_pool_too_small_for_one_request_of_max_model_len_is_refused_at_start(
    dense_prompt, num_blocks, fits, window_block
):
    from leank_infer import MaskError

    if fits:
        _manager(num_blocks, dense_prompt, window_block=window_block)
        return
    rule = "dense-prompt" if dense_prompt else "positional"
    window = (171 if dense_prompt else 22) if window_block == 9 else (96 if dense_prompt else 13)
    need = 96 + 2 * window
    with pytest.raises(MaskError) as err:
        _manager(num_blocks, dense_prompt, window_block=window_block)
    assert (f"the KV pool's {num_blocks - 1} blocks cannot hold one request of max_model_len 1536 "
            f"under the {rule} rule: it needs at least {need} at once") in str(err.value)  # fmt: skip


def test_the_spec_counts_a_sink_longer_than_any_request_as_the_request():
    """A sink beyond max_model_len holds at most the request's own blocks (it asked vLLM for 2**31 tokens' worth)."""
    import torch

    from leank_infer.vllm.kv_specs import LeanKWindowSpec

    spec = LeanKWindowSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32, sliding_window=80,
                           sink_len=2**31 - 1)  # fmt: skip
    assert spec.steady_blocks(4096) == 256 + 2 * (5 + 1)


def test_an_engine_whose_pool_cannot_hold_one_long_prompt_stops_at_start(model_dir, alarm):
    """The probe: ``num_gpu_blocks_override=160`` (16-token pages then; 100 with the 40- and 24-token pages of today), ``max_model_len=1536`` and 1k-token prompts under the dense-prompt
    rule used to start, then hold every request waiting, 0 running, forever. Now the engine does not start."""
    from vllm import LLM, SamplingParams

    from leank_infer import MaskError

    alarm(600)  # the old behaviour: a generate that never returns
    engine = {**EAGER, "max_model_len": 1536}
    with pytest.raises(MaskError) as err:
        llm = LLM(model=str(model_dir), additional_config={"leank_mask": MASK}, num_gpu_blocks_override=100,
                  **engine)  # fmt: skip
        prompts = [
            {"prompt_token_ids": [(7 * i + j) % 5000 + 10 for j in range(1000 + 30 * i)]} for i in range(3)
        ]
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert (
        "the KV pool's 99 blocks cannot hold one request of max_model_len 1536 under the "
        "dense-prompt rule"
        in str(err.value)
        and "\n" not in str(err.value)
    ), err.value
