"""vLLM + LeanK on the embedded SmolLM2: capacity, exact greedy decoding, batching, start-up errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from .conftest import ENGINE, MASK, plain_kv_tokens, reference_tokens

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
LENGTHS = (330, 760, 1250)  # sink 16 + recent 64 + accumu 16: every prompt has a long pruned middle


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Prose prompts of several lengths (token ids, so vLLM and transformers see the same input)."""
    import pydoc_data.topics

    text = " ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text).input_ids
    question = tokenizer("\n\nIn one sentence, what is the text above about?").input_ids
    return [ids[1000 * i : 1000 * i + n] + question for i, n in enumerate(LENGTHS)]


def generate(llm, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def backend_impls(llm):
    """The LeanK attention implementations of the in-process engine's model, by layer."""
    from leank_infer.vllm.backend import LeanKCPUAttentionImpl

    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return [
        layer.impl
        for layer in ctx.values()
        if isinstance(getattr(layer, "impl", None), LeanKCPUAttentionImpl)
    ]


def test_kv_capacity_grows_by_the_bytes_ratio(leank_llm):
    from leank_infer import ChannelMask

    tokens = leank_llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens
    ratio = ChannelMask.from_pretrained(MASK).stats(dtype=torch.float32)["bytes_per_token"]["ratio"]
    plain = plain_kv_tokens()
    # vLLM's own count, from the pages LeanK gave it: the dense count over the mask's bytes ratio
    assert tokens == pytest.approx(plain / ratio, rel=0.02), (tokens, plain, ratio)
    assert tokens >= 1.8 * plain
    impls = backend_impls(leank_llm)
    assert len(impls) == 30 and all(i.layout is not None for i in impls)


def test_greedy_equals_leank_model_generate(leank_llm, prompts):
    """Concurrent requests of different lengths, token for token equal to LeanKModel.generate (each alone)."""
    batched = generate(leank_llm, prompts)
    want = reference_tokens(prompts, NEW_TOKENS)
    assert batched == want
    # the same requests one at a time give the same tokens as the batch
    assert [generate(leank_llm, [p])[0] for p in prompts[:2]] == batched[:2]


def test_side_store_holds_only_sink_and_recent(leank_llm, prompts):
    """Full-channel K/V beside the pages: sink + recent + accumu + 1 tokens at most, finished requests dropped."""
    generate(leank_llm, prompts)
    generate(leank_llm, prompts[-1:])
    for impl in backend_impls(leank_llm):
        m = impl.mask
        assert len(impl.states) == 1  # the requests of the first call finished: their state is gone
        (st,) = impl.states.values()
        assert st.length == len(prompts[-1]) + NEW_TOKENS - 1  # the last sampled token is never fed back
        assert st.head_k.shape[0] + st.tail_k.shape[0] <= m.sink_size + m.recent_size + m.accumu_size + 1


def test_mask_for_another_model_fails_at_start(model_dir, tmp_path):
    """A mask of another shape: one MaskError naming the field, raised while the model is built."""
    from vllm import LLM

    from leank_infer import ChannelMask, MaskError

    ChannelMask.full(2, 2, 16, base_model="tiny/other").save_pretrained(tmp_path / "other")
    with pytest.raises(Exception) as err:
        LLM(model=str(model_dir), additional_config={"leank_mask": str(tmp_path / "other")}, **ENGINE)
    assert "num_layers is 2 in the mask but 30 in the model" in str(err.value) or isinstance(
        err.value, MaskError
    )


def test_damaged_and_missing_masks_are_one_clear_error(tmp_path):
    """The settings path loads masks with ChannelMask's checks: a missing folder, a damaged file."""
    from types import SimpleNamespace

    from leank_infer import MaskError
    from leank_infer.vllm.settings import load_checked_mask, settings_from

    cfg = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    with pytest.raises(MaskError, match="not a folder"):
        load_checked_mask(settings_from({"leank_mask": str(tmp_path / "nowhere")}), cfg)
    bad = tmp_path / "bad"
    shutil.copytree(MASK, bad)
    (bad / "mask.safetensors").write_bytes((bad / "mask.safetensors").read_bytes()[:100])
    with pytest.raises(MaskError, match="damaged or truncated"):
        load_checked_mask(settings_from({"leank_mask": str(bad)}), cfg)
    (bad / "config.json").write_text(json.dumps({"format_version": 99}))
    with pytest.raises(MaskError, match="format_version"):
        load_checked_mask(settings_from({"leank_mask": str(bad)}), cfg)


def test_engine_settings_leank_cannot_serve_are_refused():
    from types import SimpleNamespace

    from leank_infer import MaskError
    from leank_infer.vllm.backend import check_engine

    def config(prefix=False, chunked=False, tp=1, dtype="auto"):
        return SimpleNamespace(
            cache_config=SimpleNamespace(enable_prefix_caching=prefix, cache_dtype=dtype),
            scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        )

    check_engine(config())
    for kwargs, words in (
        ({"prefix": True}, "no-enable-prefix-caching"),
        ({"chunked": True}, "no-enable-chunked-prefill"),
        ({"tp": 2}, "tensor parallelism"),
        ({"dtype": "fp8"}, "quantised KV cache"),
    ):
        with pytest.raises(MaskError, match=words):
            check_engine(config(**kwargs))
