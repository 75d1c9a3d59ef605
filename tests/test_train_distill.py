"""The distillation term drives alpha: through the loss the optimizer sees (``training_step``), not only the L1.

Without it (e.g. ``training_step`` returning ``distill.detach() + reg``) the L1 alone would still move
alpha, uniformly over channels, and every test that checks only "alpha moved" would pass.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import tiny_model
from safetensors.torch import save_file

from leank_infer.mask import binarize
from leank_train.distill.module import LeanKDistillation

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings(r"ignore:Found \d+ module\(s\) in eval mode"),
    pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`"),
]

SIZES = dict(sink_size=4, recent_size=8, align=4)
PLANTED = (3, 11)  # a rotate-half RoPE pair (c, c + head_dim/2): they rotate together


def _batch(total: int = 60, context: int = 50, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 128, (1, total), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": torch.where(torch.arange(total) >= context, ids, -100),
            "context_len": torch.tensor([context])}


def _fit(module: LeanKDistillation, batch: dict[str, torch.Tensor], steps: int) -> None:
    """``steps`` optimizer steps of Lightning on the same batch."""
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader([batch] * steps, batch_size=None))


def _distill(module: LeanKDistillation, batch: dict[str, torch.Tensor]) -> float:
    with torch.no_grad():
        return float(module.losses(batch)[0])


def test_distillation_gradient_is_where_the_rule_says_and_descends():
    """reg 0: the step's loss has a gradient on alpha in the global layer (every channel: every middle key
    sees them all), none in Gemma 2's sliding layer, none without middle keys; and it points downhill."""
    module = LeanKDistillation.for_model(tiny_model("gemma2"), reg_weight=0.0, **SIZES)
    assert module.dense_layers == (0,)
    batch = _batch()
    with torch.no_grad():
        module.alpha.fill_(0.5)
    module.training_step(batch, 0).backward()
    grad = module.alpha.grad.clone()
    assert torch.count_nonzero(grad[0]) == 0  # the sliding layer is dense: alpha is unused there
    assert bool((grad[1] != 0).all())
    with torch.no_grad():  # a small step against the gradient lowers the loss, one along it raises it
        start, base = module.alpha.clone(), _distill(module, batch)
        module.alpha.copy_(start - 1e-2 * grad / grad.norm())
        down = _distill(module, batch)
        module.alpha.copy_(start + 1e-2 * grad / grad.norm())
        up = _distill(module, batch)
    assert down < base < up
    # the last answer query is at 12 = sink + recent: no answer token has a middle key, no gradient
    module.alpha.grad = None
    with torch.no_grad():
        module.alpha.copy_(start)
    module.training_step(_batch(total=13, context=10), 0).backward()
    assert module.alpha.grad is None or torch.count_nonzero(module.alpha.grad) == 0


def test_a_few_steps_lower_the_distillation_loss(tmp_path):
    """From alpha = 0.3 everywhere, reg 0: ten Lightning steps on one batch lower that batch's distillation loss."""
    save_file({"alpha": torch.full((2, 2, 16), 0.3)}, str(tmp_path / "alpha.safetensors"))
    module = LeanKDistillation.for_model(tiny_model("llama"), reg_weight=0.0, lr=0.05, warmup_steps=1,
                                         init_scores=str(tmp_path / "alpha.safetensors"), **SIZES)
    batch = _batch()
    before = _distill(module, batch)
    _fit(module, batch, 10)
    after = _distill(module, batch)
    assert after < 0.7 * before, (before, after)


def _planted_model() -> torch.nn.Module:
    """A tiny Llama whose channels 3 and 11 of every head carry most of q.k (their q/k rows scaled 8x)."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for c in PLANTED:
                attn.k_proj.weight.view(2, 16, -1)[:, c] *= 8
                attn.q_proj.weight.view(4, 16, -1)[:, c] *= 8
    return model


def test_channels_that_carry_the_answer_survive_the_l1_pull():
    """Stage 1 with a strong L1: the L1 alone lowers every alpha alike (the binarisation would then keep the
    lowest channel indices of each head); the distillation holds up the channels carrying q.k, so they
    are the highest alpha of every head and the ones a binarisation keeps."""
    module = LeanKDistillation.for_model(_planted_model(), reg_weight=0.5, lr=0.05, warmup_steps=1, **SIZES)
    _fit(module, _batch(), 30)
    alpha = module.alpha.detach()
    others = [c for c in range(16) if c not in PLANTED]
    assert float(alpha.max()) < 0.5  # the L1 pulled everything down...
    assert bool((alpha[..., list(PLANTED)].min(-1).values > alpha[..., others].max(-1).values).all())  # ...but these less
    keep = binarize(alpha, 1 - 2 / 16, 2)
    assert keep.nonzero()[:, -1].unique().tolist() == list(PLANTED)
    assert bool((keep.sum(-1) == 2).all())


def test_the_loss_by_hand_label_tokens_only_and_l1_over_the_pruned_layers():
    """sample_distill is the mean over label tokens (not -100) of the per-token mean squared error of the
    last hidden states; the L1 is reg_weight * mean |alpha| over the layers LeanK prunes (not Gemma 2's
    sliding layer 0; three layers and two KV heads, so a count of heads cannot pass for the count of layers);
    a batch without ``length`` is all full length; each sample is scored on its own labels only (a batch of two
    with different label masks is the mean of the two); mismatched sizes are named."""
    layers = ["sliding_attention", "full_attention", "full_attention"]
    model = tiny_model("gemma2", num_hidden_layers=3, layer_types=layers)
    module = LeanKDistillation.for_model(model, reg_weight=0.25, **SIZES)
    assert module.alpha.shape[:2] == (3, 2)
    with torch.no_grad():
        module.alpha.copy_(torch.rand(module.alpha.shape, generator=torch.Generator().manual_seed(4)))
        module.alpha[0] = 1.0  # the dense layer's alpha (unused) must not count in the L1
    batch = _batch()
    ids, labels = batch["input_ids"], batch["labels"].clone()
    with torch.no_grad():
        teacher, student = module.hidden_states(ids, 50)
        per_token = (teacher.float() - student.float()).pow(2).mean(-1)[0]  # the 10 answer tokens
        assert per_token.shape == (10,) and bool((per_token > 0).all())
        labels[0, 50:55] = -100
        torch.testing.assert_close(module.sample_distill(ids, labels, 50), per_token[5:].mean())
        labels[0, 55:59] = -100  # one label token left
        torch.testing.assert_close(module.sample_distill(ids, labels, 50), per_token[9])
        labels[0, 59] = -100
        assert float(module.sample_distill(ids, labels, 50)) == 0.0  # no label: 0, not NaN
        distill, reg = module.losses(batch)
        torch.testing.assert_close(distill, per_token.mean())
        torch.testing.assert_close(reg, 0.25 * module.alpha[1:].abs().mean())
        # two samples of the same tokens: the first labels its last 5 answer tokens, the second all 10
        pair = {"input_ids": ids.repeat(2, 1), "context_len": torch.tensor([50, 50]),
                "labels": torch.cat([torch.where(torch.arange(60) >= 55, ids, -100), batch["labels"]])}
        torch.testing.assert_close(module.losses(pair)[0], (per_token[5:].mean() + per_token.mean()) / 2)
        with pytest.raises(ValueError, match="one entry per sample"):
            module.losses({**batch, "length": torch.tensor([60, 60])})


def test_stage2_channel_scale_keeps_the_sliding_layer_whole(tmp_path):
    """Stage 2 binarises alpha over the global layers only: Gemma 2's sliding layer 0 keeps every channel,
    and the global layer keeps about (1 - ratio) of its own channels (high layer-0 scores take none of its budget)."""
    scores = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(5)) * 0.5
    scores[0] += 0.5
    save_file({"scores": scores}, str(tmp_path / "scores.safetensors"))
    module = LeanKDistillation.for_model(tiny_model("gemma2"), stage=2, ratio=0.5,
                                         init_scores=str(tmp_path / "scores.safetensors"), **SIZES)
    scale = module.channel_scale().detach()
    assert bool((scale[0] == 1).all()) and int(scale[1].sum()) > int(binarize(scores, 0.5, 4)[1].sum())
    assert torch.equal(scale.bool(), binarize(scores, 0.5, 4, dense_layers=(0,)))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_positional_student_is_the_rule_the_vllm_plugin_serves(tmp_path, family):
    """student_rule="positional": the student's answer states are those of LeanKModel(rule="positional") over
    the whole sequence with the exported mask (every prompt query pruned too), not the dense-prompt student's;
    and its loss has its own gradient on alpha, which points downhill."""
    from leank_infer import LeanKModel

    model = tiny_model(family)
    layers = model.config.num_hidden_layers
    heads = model.config.num_key_value_heads
    scores = torch.rand(layers, heads, 16, generator=torch.Generator().manual_seed(3))
    save_file({"scores": scores}, str(tmp_path / "scores.safetensors"))
    kw = dict(stage=2, ratio=0.5, init_scores=str(tmp_path / "scores.safetensors"), reg_weight=0.0, **SIZES)
    positional = LeanKDistillation.for_model(model, student_rule="positional", accumu_size=4, **kw)
    batch = _batch(total=70, context=50)
    ids, context = batch["input_ids"], 50
    with torch.no_grad():
        teacher, student = positional.hidden_states(ids, context)
        mask = positional.mask(recent_size=SIZES["recent_size"], accumu_size=4)
        lk = LeanKModel(model, mask, rule="positional")
        want = lk(input_ids=ids, past_key_values=lk.new_cache()).logits[:, context:]
        got = model.lm_head(student)
        if family == "gemma2":  # the final soft-capping of Gemma 2's logits
            cap = model.config.final_logit_softcapping
            got = torch.tanh(got / cap) * cap
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        dense = LeanKDistillation.for_model(model, **kw)
        assert not torch.allclose(dense.hidden_states(ids, context)[1], student, atol=1e-4)
        assert not torch.allclose(teacher, student, atol=1e-4)
    # stage 1 (alpha continuous, reg 0): the positional loss has a gradient that points downhill, and it is not the
    # dense-prompt student's (the prompt's pruned queries are part of it)
    grads = {}
    for rule in ("positional", "dense-prompt"):
        m = LeanKDistillation.for_model(model, reg_weight=0.0, student_rule=rule, accumu_size=4, **SIZES)
        with torch.no_grad():
            m.alpha.fill_(0.5)
        m.training_step(batch, 0).backward()
        grads[rule] = m.alpha.grad.clone()
    m = LeanKDistillation.for_model(model, reg_weight=0.0, student_rule="positional", accumu_size=4, **SIZES)
    grad = grads["positional"]
    dense_layers = list(m.dense_layers)
    assert torch.count_nonzero(grad[dense_layers]) == 0 if dense_layers else True
    assert not torch.allclose(grad, grads["dense-prompt"], rtol=1e-2)
    with torch.no_grad():
        m.alpha.fill_(0.5)
        start, base = m.alpha.clone(), _distill(m, batch)
        m.alpha.copy_(start - 1e-2 * grad / grad.norm())
        down = _distill(m, batch)
        m.alpha.copy_(start + 1e-2 * grad / grad.norm())
        up = _distill(m, batch)
    assert down < base < up
