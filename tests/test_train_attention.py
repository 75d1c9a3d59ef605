"""The student pass: exactness at alpha = 1, where gradients reach alpha, the straight-through mask."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from leank_infer.mask import binarize
from leank_train.distill.module import LeanKDistillation, binary_ste

SINK, RECENT = 4, 8


def _module(family: str = "llama", **kwargs) -> LeanKDistillation:
    kwargs = {"sink_size": SINK, "recent_size": RECENT, "align": 4, **kwargs}
    return LeanKDistillation.for_model(tiny_model(family), **kwargs)


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def test_all_ones_student_equals_teacher(family):
    module = _module(family)
    ids = _ids(80)
    teacher, student = module.hidden_states(ids, 70)
    assert teacher.shape == student.shape == (1, 10, 64)
    torch.testing.assert_close(student, teacher, atol=2e-5, rtol=1e-5)


def test_pruning_changes_student_not_teacher():
    module = _module()
    ids = _ids(80)
    teacher_full, _ = module.hidden_states(ids, 70)
    with torch.no_grad():
        module.alpha.zero_()
    teacher_zero, student_zero = module.hidden_states(ids, 70)
    torch.testing.assert_close(teacher_zero, teacher_full, atol=0, rtol=0)
    assert (student_zero - teacher_zero).abs().max() > 1e-4


def _alpha_grad(module: LeanKDistillation, ids: torch.Tensor, context_len: int) -> torch.Tensor:
    module.alpha.grad = None
    with torch.no_grad():
        module.alpha.fill_(0.5)
    teacher, student = module.hidden_states(ids, context_len)
    (teacher - student).pow(2).mean().backward()
    return module.alpha.grad


def test_no_middle_keys_no_gradient():
    # the last answer query sits at position total-1; its middle [sink, p - recent) is empty
    # when total - 1 - recent <= sink: then alpha must not matter at all
    module = _module()
    total = SINK + RECENT + 1
    grad = _alpha_grad(module, _ids(total), total - 3)
    assert grad is None or torch.count_nonzero(grad) == 0


def test_middle_keys_give_gradient_on_every_layer():
    module = _module()
    grad = _alpha_grad(module, _ids(60), 50)
    assert grad is not None
    assert (grad.abs().sum(dim=(1, 2)) > 0).all()


def test_one_more_token_opens_the_middle():
    # one token past the boundary: only key position `sink` becomes middle for the last query
    module = _module()
    total = SINK + RECENT + 2
    grad = _alpha_grad(module, _ids(total), total - 3)
    assert grad is not None and torch.count_nonzero(grad) > 0


def test_ste_forward_is_binary_and_backward_reaches_alpha():
    alpha = torch.rand(3, 2, 16, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    mask = binary_ste(alpha, ratio=0.5, align=4)
    assert set(mask.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(mask.bool(), binarize(alpha.detach(), 0.5, 4))
    weights = torch.randn_like(alpha)
    (mask * weights).sum().backward()
    torch.testing.assert_close(alpha.grad, weights)
    # dense (sliding) layers keep every channel and stay out of the ratio, as in binarize
    high = alpha.detach() + torch.tensor([1.0, 0.0, 0.0]).view(3, 1, 1)  # layer 0 would take the budget
    dense = binary_ste(high, 0.5, 4, 0, (0,))
    assert bool(dense[0].all()) and torch.equal(dense.bool(), binarize(high, 0.5, 4, dense_layers=(0,)))
    assert dense[1:].sum() == 0.5 * dense[1:].numel() > binary_ste(high, 0.5, 4)[1:].sum()


def test_ste_without_min_kept_is_the_plain_quantile_rule():
    """binary_ste's default is the plain rule (min_kept 0): on scores 0..7 at ratio 0.3 the threshold is the
    interpolated 0.3-quantile, 2.1, so channels 3..7 stay (5 of 8); any min_kept > 0 instead bisects for the
    total nearest the budget 5.6 and keeps 6."""
    alpha = torch.arange(8.0).view(1, 1, 8).requires_grad_(True)
    assert binary_ste(alpha, 0.3, 1)[0, 0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert int(binary_ste(alpha, 0.3, 1, 1).sum()) == 6


def test_stage2_step_uses_the_binary_mask_and_trains_alpha(tmp_path):
    from safetensors.torch import save_file

    scores = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(2))
    save_file({"scores": scores}, str(tmp_path / "scores.safetensors"))
    module = _module(stage=2, init_scores=str(tmp_path / "scores.safetensors"), ratio=0.5, reg_weight=0.0)
    torch.testing.assert_close(module.alpha.detach(), scores)
    scale = module.channel_scale()
    assert set(scale.detach().unique().tolist()) <= {0.0, 1.0}
    ids = _ids(60)
    batch = {"input_ids": ids, "labels": torch.where(torch.arange(60) >= 50, ids, -100), "context_len": torch.tensor([50])}
    distill, reg = module.losses(batch)
    assert reg == 0
    distill.backward()
    assert torch.count_nonzero(module.alpha.grad) > 0


@pytest.mark.parametrize("ratio,align", [(0.7, 4), (0.5, 8), (0.25, 16)])
def test_exported_mask_respects_ratio_and_align(ratio, align):
    module = _module(ratio=ratio, align=align)
    with torch.no_grad():
        module.alpha.copy_(torch.rand(module.alpha.shape, generator=torch.Generator().manual_seed(3)))
    mask = module.mask(recent_size=16, accumu_size=4)
    counts = mask.kept_counts
    assert (counts % align == 0).all()
    heads = counts.numel()
    # each head's count is rounded to align: the total is within half an align per head of the budget
    assert abs(int(counts.sum()) - (1 - ratio) * mask.keep.numel()) <= heads * align / 2
    assert mask.ratio == ratio and mask.align == align and mask.sink_size == SINK
    # per head, the kept channels are the highest-scoring ones
    for layer in range(mask.num_layers):
        for head in range(mask.num_kv_heads):
            kept = mask.scores[layer, head][mask.keep[layer, head]]
            dropped = mask.scores[layer, head][~mask.keep[layer, head]]
            if kept.numel() and dropped.numel():
                assert kept.min() >= dropped.max()
