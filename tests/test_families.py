"""Model families beyond Llama/Qwen/Mistral: Gemma 2 (soft-capping, sliding layers), Gemma 3, Phi-3.

For each: a LeanK decode with a pruned mask equals the dense LeanK rule (the student attention over
full K/V) step by step, a short fit trains and exports a mask, and what Gemma's sliding-window
layers keep is the model's own sliding cache.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import FAMILIES, MORE_FAMILIES, tiny_model
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from leank_infer import ChannelMask, LeanKModel, MaskError
from leank_infer.attention import ChannelGroups, leank_decode_attention, softcapped_attention
from leank_infer.cache import LeanKLayer
from leank_infer.mask import binarize, dense_layers_of
from leank_infer.triton_decode import decode_attention
from leank_train.student_attention import ATTN_IMPLEMENTATION as STUDENT
from leank_train.student_attention import StudentState

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = dict(sink_size=4, recent_size=8, accumu_size=4)
ALL = FAMILIES + MORE_FAMILIES


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def pruned_mask(model, seed: int = 0, ratio: float = 0.5) -> ChannelMask:
    """A mask over the model's global layers (its sliding layers are dense), one head kept at zero channels."""
    from leank_infer.mask import model_shape

    scores = torch.rand(*model_shape(model.config), generator=torch.Generator().manual_seed(seed))
    dense = dense_layers_of(model.config)
    first_global = next(i for i in range(scores.shape[0]) if i not in dense)
    scores[first_global, 0] *= 0.05  # under the threshold: this head keeps nothing
    return ChannelMask.from_scores(scores, ratio, 4, dense_layers=dense, **SIZES)


@torch.no_grad()
def reference_steps(model, ids: torch.Tensor, n_prompt: int, mask: ChannelMask, recents: list[int]) -> list:
    """Logits of each token after the prompt under the dense LeanK rule (full K/V, the student attention).

    The prompt is attended densely (as a prefill is); token ``n_prompt + i`` then attends with the
    per-query rule at recent size ``recents[i]``, its own K/V going into the cache like a decode step's.
    """
    impl = model.config._attn_implementation
    model.set_attn_implementation(STUDENT)
    try:
        cache = DynamicCache()
        out = [model(ids[:, :n_prompt], cache=cache).logits[:, -1]]
        for i, recent in enumerate(recents):
            state = StudentState(
                channel_scale=mask.keep.float(),
                sink_size=mask.sink_size,
                recent_size=recent,
                skip_zero_heads=True,
                dense_layers=frozenset(mask.dense_layers),
            )
            p = n_prompt + i
            logits = model(
                ids[:, p : p + 1], cache=cache, position_ids=torch.tensor([[p]]), leank_student=state
            ).logits
            out.append(logits[:, -1])
        return out
    finally:
        model.set_attn_implementation(impl)


@torch.no_grad()
def leank_steps(lk: LeanKModel, ids: torch.Tensor, steps: int):
    """Greedy LeanK decoding by hand: (all tokens, logits of the prompt's last token and of each
    decoded one, the recent size each decode step used, the cache)."""
    cache = lk.new_cache()
    logits = [lk(ids, cache=cache).logits[:, -1]]
    layer = cache.layers[cache.leank_layers[0]]
    recents = []
    for _ in range(steps):
        ids = torch.cat([ids, logits[-1].argmax(-1, keepdim=True)], 1)
        logits.append(lk(ids[:, -1:], cache=cache).logits[:, -1])
        # the token at position p saw full keys [recent_start, p]: the rule at recent = p - recent_start
        recents.append(ids.shape[1] - 1 - layer.recent_start)
    return ids, logits, recents, cache


@pytest.mark.parametrize("family", ALL)
def test_pruned_decode_equals_dense_leank_rule(family):
    """Every decode step (compressions included) equals the LeanK rule over full K/V, and pruning shows."""
    model = tiny_model(family)
    mask = pruned_mask(model)
    assert (mask.kept_counts == 0).any() and not bool(mask.keep.all())
    lk = LeanKModel(model, mask)
    ids, got, recents, cache = leank_steps(lk, prompt(40), 12)
    assert cache.region_lengths()["middle"] > 0 and len(set(recents)) > 1  # compressions happened
    want = reference_steps(model, ids, 40, mask, recents)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=f"step {i}")
    with torch.no_grad():
        dense = model(ids[:, :-1]).logits[:, -1]
    assert not torch.allclose(got[-1], dense, atol=1e-4)  # the mask really pruned something


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_full_mask_generate_equals_hf(family):
    """Keeping every channel, LeanK generation is the model's own (eager/SDPA, soft-capped) generation."""
    model = tiny_model(family)
    ids = prompt(40, seed=1)
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    full = ChannelMask.full(2, 2, model.config.hidden_size // 4, dense_layers=dense_layers_of(model.config), **SIZES)
    got = LeanKModel(model, full).generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_sliding_layers_keep_the_models_sliding_cache(family):
    """Gemma's sliding layers are dense in the mask and cached by transformers' sliding layer (window - 1 tokens)."""
    model = tiny_model(family)
    assert dense_layers_of(model.config) == (0,)
    mask = pruned_mask(model)
    assert mask.dense_layers == (0,) and bool(mask.keep[0].all())
    *_, cache = leank_steps(LeanKModel(model, mask), prompt(40, seed=2), 3)
    assert isinstance(cache.layers[0], DynamicSlidingWindowLayer) and isinstance(cache.layers[1], LeanKLayer)
    assert cache.layers[0].keys.shape[2] == model.config.sliding_window - 1
    assert cache.leank_layers == [1]
    with pytest.raises(ValueError, match="dense layer"):
        cache.region_lengths(0)


def test_gemma2_softcap_matters_and_is_applied():
    """The tiny Gemma 2's soft-cap changes its logits, so the equalities above would catch a path ignoring it."""
    model = tiny_model("gemma2")
    uncapped = copy.deepcopy(model)
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert uncapped.config._attn_implementation == "eager"  # transformers' eager: soft-caps when told to
    ids = prompt(30, seed=3)
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, uncapped(ids).logits, atol=1e-3)


def test_softcapped_attention_equals_transformers_eager():
    """Our soft-capped dense attention (SDPA cannot soft-cap) is Gemma 2's eager attention."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 9, 16, generator=g) * 3 for h in (4, 2, 2))
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    additive = torch.zeros(2, 1, 9, 9).masked_fill(~causal, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.25, softcap=2.0)
    got = softcapped_attention(q, k, v, causal.expand(2, 1, 9, 9), 0.25, 2.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plain = softcapped_attention(q, k, v, causal.expand(2, 1, 9, 9), 0.25, 1e6)  # cap far above the logits
    assert not torch.allclose(plain, got, atol=1e-3)


def test_triton_dispatch_falls_back_to_torch_for_softcap():
    """The kernel does not soft-cap: the dispatcher sends soft-capped steps to the PyTorch path, whatever the backend."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(1)
    keep = binarize(torch.rand(1, 2, 16, generator=g), 0.5, 4)[0]
    groups = ChannelGroups.from_keep(keep)
    q = torch.randn(1, 4, 1, 16, generator=g) * 3
    hk, hv, tk, tv = (torch.randn(1, 2, n, 16, generator=g) for n in (4, 4, 6, 6))
    mk = [torch.randn(1, len(h), 10, c, generator=g) for h, c in zip(groups.heads, groups.counts, strict=True)]
    mv = torch.randn(1, len(groups.nonzero_order), 10, 16, generator=g)
    masks = dict(
        head_full=torch.ones(1, 1, 4, dtype=torch.bool), head_mid=torch.zeros(1, 1, 4, dtype=torch.bool),
        mid_mask=None, tail_mask=None,
    )  # fmt: skip
    args = (q, hk, hv, tk, tv, mk, mv, groups)
    want = leank_decode_attention(*args, scaling=0.25, softcap=2.0, **masks)
    for backend in ("triton", "auto", "torch"):
        got = decode_attention(*args, scaling=0.25, softcap=2.0, backend=backend, **masks)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not torch.allclose(leank_decode_attention(*args, scaling=0.25, **masks), want, atol=1e-3)


def test_all_sliding_model_is_refused_for_training():
    """A model whose every layer slides (Mistral with a window) has no global layer: one clear error."""
    from leank_train.module import LeanKDistillation

    model = tiny_model("mistral", sliding_window=16)
    with pytest.raises(MaskError, match="sliding-window"):
        LeanKDistillation.for_model(model, sink_size=4, recent_size=8, align=4)
    with pytest.raises(MaskError, match="no global layer"):
        binarize(torch.rand(2, 2, 16), 0.5, 4, dense_layers=(0, 1))


def test_dense_layers_round_trip_and_checks(tmp_path):
    scores = torch.rand(3, 2, 16, generator=torch.Generator().manual_seed(0))
    mask = ChannelMask.from_scores(scores, 0.75, 4, dense_layers=[2, 0], **SIZES)
    assert mask.dense_layers == (0, 2) and bool(mask.keep[[0, 2]].all())
    assert abs(float(mask.keep[1].float().mean()) - 0.25) < 0.13  # the ratio is over the global layer only
    back = ChannelMask.from_dir(mask.save_pretrained(tmp_path / "m"))
    assert back.dense_layers == (0, 2) and torch.equal(back.keep, mask.keep)
    with pytest.raises(MaskError, match="every channel"):
        ChannelMask(keep=mask.keep.clone().index_fill_(0, torch.tensor([1]), False), dense_layers=(1,), ratio=0.5, align=4)
    with pytest.raises(MaskError, match="layer indices"):
        ChannelMask(keep=mask.keep, dense_layers=(5,), ratio=0.5, align=4)
