"""With a mask that keeps every channel, vLLM + LeanK generates what plain vLLM generates."""

from __future__ import annotations

import gc

import pytest

from .conftest import EAGER
from .test_vllm_plugin import LENGTHS, generate, prompts  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


def test_all_ones_mask_equals_plain_vllm(model_dir, prompts, tmp_path):  # noqa: F811
    from vllm import LLM

    from leank_infer import ChannelMask

    ChannelMask.full(30, 3, 64, base_model="HuggingFaceTB/SmolLM2-135M-Instruct").save_pretrained(
        tmp_path / "ones"
    )
    plain = LLM(model=str(model_dir), **EAGER)
    want = generate(plain, prompts)
    del plain
    gc.collect()
    ones = LLM(model=str(model_dir), additional_config={"leank_mask": str(tmp_path / "ones")}, **EAGER)
    got = generate(ones, prompts)
    assert len(got) == len(LENGTHS)
    assert got == want
