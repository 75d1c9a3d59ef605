"""vLLM + LeanK on the embedded SmolLM2 with vLLM's defaults: the pool, exact greedy decoding, prefix caching,
chunked prefill, preemption, start-up errors (the tests of scheduling and KV dtypes on eager engines, conftest's
``EAGER``)."""

from __future__ import annotations

import gc
import json
import shutil

import pytest
import torch

from .conftest import EAGER, ENGINE, KV_SPACE_GIB, MASK, plain_kv_tokens, reference_tokens

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
LENGTHS = (330, 760, 1250)  # sink 16 + recent 64 + accumu 16: every prompt has a long pruned middle


def prose(tokenizer) -> list[int]:
    import pydoc_data.topics

    text = " ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    return tokenizer(text).input_ids


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Prose prompts of several lengths (token ids, so vLLM and transformers see the same input)."""
    ids = prose(tokenizer)
    question = tokenizer("\n\nIn one sentence, what is the text above about?").input_ids
    return [ids[1000 * i : 1000 * i + n] + question for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def shared(tokenizer) -> list[list[int]]:
    """One 1,500-token document, three questions about it: what a RAG or chat server sees."""
    doc = prose(tokenizer)[5000:6500]
    asks = ["\n\nWhat is the first topic above?", "\n\nName one keyword used above.", "\n\nSummarise the above."]
    return [doc + tokenizer(a).input_ids for a in asks]


def generate(llm, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in run(llm, prompts, n)]


def run(llm, prompts: list[list[int]], n: int = NEW_TOKENS) -> list:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def leank_impls(llm) -> list:
    """The LeanK attention implementations of the in-process engine's model."""
    from leank_infer.vllm.backend import LeanKAttentionMixin

    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return [m.impl for m in ctx.values() if isinstance(getattr(m, "impl", None), LeanKAttentionMixin)]


def counter(llm, name: str) -> float:
    """A vLLM metric's value (e.g. ``vllm:num_preemptions``), summed over its labels."""
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def test_every_leank_byte_is_in_vllms_pool_and_its_report(leank_llm):
    """The KV cache size vLLM reports counts the packed and the window pages, and nothing lives outside."""
    from vllm.utils.math_utils import cdiv

    from leank_infer.vllm.kv_specs import kv_specs

    cfg = leank_llm.llm_engine.vllm_config
    impls = leank_impls(leank_llm)
    assert len(impls) == 30 and all(i.slot is not None for i in impls)
    plan = impls[0].plan
    # pool.fit_blocks: block sizes filling the pages, hits no coarser than plain vLLM's 128 tokens
    assert (plan.block_size, plan.window_block, len(plan.window_layers)) == (40, 24, 1)
    packed, window = kv_specs(plan, torch.float32)
    num_blocks = cfg.cache_config.num_gpu_blocks
    assert num_blocks == KV_SPACE_GIB * 2**30 // packed.page_size_bytes  # one pool, one page size
    per_request = cdiv(cfg.model_config.max_model_len, plan.block_size) + len(plan.window_layers) * (
        window.max_memory_usage_bytes(cfg) // window.page_size_bytes
    )
    assert cfg.cache_config.kv_cache_size_tokens == int(num_blocks / per_request * cfg.model_config.max_model_len)
    assert cfg.cache_config.kv_cache_size_tokens >= 1.8 * plain_kv_tokens()
    # every tensor LeanK reads or writes is a view of vLLM's one KV tensor: no side store
    pool = {i.window_store.kv_cache.untyped_storage().data_ptr() for i in impls}
    ctx = cfg.compilation_config.static_forward_context
    pool |= {ctx[name].kv_cache.untyped_storage().data_ptr() for name in ctx if name.endswith("leank_packed")}
    assert len(pool) == 1
    assert not any(isinstance(v, (dict, list)) and v for i in impls for v in vars(i).values() if v is not i.vllm_config)


def test_greedy_equals_leank_model(leank_llm, prompts):
    """Concurrent requests of different lengths, token for token equal to LeanKModel(rule="dense-prompt"), the
    plugin's default rule; and not to the positional rule's (so the test tells the two apart)."""
    batched = generate(leank_llm, prompts)
    assert batched == reference_tokens(prompts, NEW_TOKENS)
    assert batched != reference_tokens(prompts, NEW_TOKENS, rule="positional")
    assert [generate(leank_llm, [p])[0] for p in prompts[:2]] == batched[:2]  # alone = in a batch


def test_a_prefix_cache_hit_equals_a_miss(leank_llm, shared):
    """Requests sharing a long document hit vLLM's prefix cache; their tokens equal an uncached run's.

    Under the dense-prompt rule the first request's prompt blocks (full rows) stay cached after its prompt is
    computed, so the second and third requests hit the whole document (the positional rule's own path, the
    window kept at the shared-prefix junction, is tested in test_vllm_kv_specs.py and by the positional test)."""
    leank_llm.reset_prefix_cache()
    first = run(leank_llm, shared[:1])
    second = run(leank_llm, shared[1:2])
    hit = run(leank_llm, shared[2:])
    assert hit[0].num_cached_tokens >= 1024, [o.num_cached_tokens for o in first + second + hit]
    misses = []
    for p in shared[1:]:
        leank_llm.reset_prefix_cache()
        misses += run(leank_llm, [p])
    assert [o.num_cached_tokens for o in misses] == [0, 0]
    got = [list(o.outputs[0].token_ids) for o in second + hit]
    assert got == [list(o.outputs[0].token_ids) for o in misses]
    assert list(first[0].outputs[0].token_ids) == reference_tokens(shared[:1], NEW_TOKENS)[0]


@pytest.fixture(scope="module")
def unchunked(leank_llm, shared, prompts) -> list[list[int]]:
    """The default engine's tokens: vLLM's default budget (8,192 tokens a step) prefills these whole."""
    assert leank_llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens >= 2 * 1600
    leank_llm.reset_prefix_cache()
    return generate(leank_llm, shared + prompts)


@pytest.mark.parametrize("budget, align, engine", [(256, None, ENGINE), (1024, None, EAGER), (256, 16, EAGER)])
def test_chunk_sizes_agree(model_dir, shared, prompts, unchunked, budget, align, engine):
    """Prefill chunks of 256 and 1,024 tokens give the unchunked tokens (and prefix hits inside the run, at multiples
    of 120 tokens: packed pages of 40, window pages of 24); so do packed pages of 16 tokens and window pages of 8
    (``leank_prefix_align`` 16: hits at multiples of 16). The first engine compiles the model as vLLM does by default,
    the others run eager (:data:`~.conftest.EAGER`)."""
    from vllm import LLM

    config = {"leank_mask": MASK} | ({"leank_prefix_align": align} if align else {})
    llm = LLM(model=str(model_dir), additional_config=config, max_num_batched_tokens=budget, **engine)
    try:
        plan = leank_impls(llm)[0].plan
        assert (plan.block_size, plan.window_block) == ((16, 8) if align else (40, 24))
        assert generate(llm, shared + prompts) == unchunked
    finally:
        del llm
        gc.collect()


def test_preemption_and_resumption_are_exact(model_dir, prompts, unchunked, shared):
    """vLLM preempts every running request twice while they decode (its own
    ``reset_prefix_cache(reset_running_requests=True)``: blocks freed, requests back in the waiting queue,
    recomputed later from their prompt and the tokens so far); the tokens do not change."""
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=str(model_dir), additional_config={"leank_mask": MASK}, disable_log_stats=False, **EAGER)
    try:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        requests = shared + prompts
        for i, p in enumerate(requests):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params)
        done: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
            steps += 1
            if steps in (3, 7):  # every request prefilled, some tokens out, more to come
                assert engine.reset_prefix_cache(reset_running_requests=True)
        assert counter(llm, "vllm:num_preemptions") >= len(requests), "not every request was preempted"
        assert [done[str(i)] for i in range(len(requests))] == unchunked
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("kv_dtype, element_bytes", [("fp8", 1), ("bfloat16", 2)])
def test_a_smaller_kv_dtype_stores_its_bytes_holds_more_and_keeps_the_answers(
    model_dir, prompts, unchunked, kv_dtype, element_bytes
):
    """fp8 KV, and bf16 KV under the fp32 weights: every LeanK store is that many bytes an element, vLLM reports >=
    1.8x plain vLLM's tokens at that KV dtype, greedy tokens stay those of fp32 KV (e4m3 keeps 3 mantissa bits, bf16
    7: a 135M model's top token rarely moves)."""
    from vllm import LLM

    from leank_infer.vllm.stores import Store

    llm = LLM(model=str(model_dir), additional_config={"leank_mask": MASK}, kv_cache_dtype=kv_dtype, **EAGER)
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        assert cache.kv_cache_size_tokens >= 1.8 * plain_kv_tokens(element_bytes=element_bytes)
        ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
        stores = [m for m in ctx.values() if isinstance(m, Store)]
        assert stores and all(s.kv_cache.element_size() == element_bytes for s in stores)
        got = generate(llm, prompts)
        want = unchunked[-len(prompts) :]
        assert [g[0] for g in got] == [w[0] for w in want]  # the first answer token of every prompt
        same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
        assert same >= 0.75 * sum(len(w) for w in want), (got, want)
    finally:
        del llm
        gc.collect()


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


def test_the_positional_rule_chunked_and_cached_equals_leank_model(model_dir, shared, prompts):
    """``leank_rule: "positional"``, 256-token chunks, a shared document hit in the prefix cache: token for token
    LeanKModel(rule="positional")'s. (Last in the module: deleting an engine tears down vLLM's process-wide
    state, which the module's shared engine needs.)"""
    from vllm import LLM

    config = {"leank_mask": MASK, "leank_rule": "positional"}
    llm = LLM(model=str(model_dir), additional_config=config, max_num_batched_tokens=256, **EAGER)
    try:
        got = generate(llm, shared[:1]) + generate(llm, shared[1:] + prompts)
        assert got == reference_tokens(shared + prompts, NEW_TOKENS, rule="positional")
    finally:
        del llm
        gc.collect()
