"""`leank eval` pieces: unseen probes, the two baselines at equal K budget, the whole loop on a tiny model."""

from __future__ import annotations

import torch
from conftest import tiny_model
from test_model import tiny_repo

from leank_infer import ChannelMask, LeanKModel
from leank_train.evaluate import evaluate, random_mask_like, think_mask


def _mask(seed=0):
    return ChannelMask.from_scores(torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(seed)) ** 2, 0.6, 4,
                                   sink_size=4, recent_size=8, accumu_size=4)


def test_random_baseline_keeps_the_same_count_per_head():
    mask = _mask()
    rnd = random_mask_like(mask, seed=3)
    assert torch.equal(rnd.kept_counts, mask.kept_counts)
    assert not torch.equal(rnd.keep, mask.keep)


def test_think_baseline_keeps_the_channels_with_the_largest_q_k_norms():
    model = tiny_model("llama")
    mask = _mask()
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    th = think_mask(model, ids, mask, window=8)
    per_head = int(round(float(mask.keep.float().mean()) * 16))
    assert (th.kept_counts == per_head).all()  # same budget, uniform over heads (ThinK)
    assert model.config._attn_implementation == "sdpa"  # the recording prefill gives the model back as it was
    # recompute the rule for layer 0 from the model's own q/k, computed here by hand (layer 0 reads the embeddings)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    with torch.no_grad():
        h = model.model.embed_tokens(ids)
        x = model.model.layers[0].input_layernorm(h)
        attn = model.model.layers[0].self_attn
        cos, sin = model.model.rotary_emb(h, torch.arange(40)[None])
        q = attn.q_proj(x).view(1, 40, -1, 16).transpose(1, 2)
        k = attn.k_proj(x).view(1, 40, -1, 16).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    from leank_train.evaluation.prefill import prefill

    pre = prefill(model, ids, torch.ones_like(ids), window=8)  # what ThinK reads: the recorded q, the cache's k
    torch.testing.assert_close(pre.queries[0], q[:, :, -8:])
    torch.testing.assert_close(pre.keys[0], k)
    qn = q[:, :, -8:].reshape(1, 2, 2, -1, 16).pow(2).sum((0, 2, 3)).sqrt()
    kn = k.pow(2).sum((0, 2)).sqrt()
    expected = torch.zeros(2, 16, dtype=torch.bool)
    expected.scatter_(-1, (qn * kn).topk(per_head, -1).indices, True)
    assert torch.equal(th.keep[0], expected)


def test_evaluate_runs_every_method(tmp_path):
    mask_dir, _ = tiny_repo(tmp_path)
    lm = LeanKModel.from_pretrained(mask_dir)
    res = evaluate(lm, lengths=[48], samples=2, kinds=["passkey"], seed=0, kl=False, max_new_tokens=4,
                   sentences=["w5 w6 w7 w8 w9 w10 w11 w12."] * 20)
    assert set(res["accuracy"]) == {"full", "leank", "random", "think"}
    assert len(res["answers"]) == 2 and all(0.0 <= v[48] <= 1.0 for v in res["accuracy"].values())


def test_eval_cli_plot_and_card_keep_earlier_results(tmp_path, capsys):
    import json

    from leank_infer.cli import main as leank

    mask_dir, _ = tiny_repo(tmp_path)
    plot, out = tmp_path / "acc.png", tmp_path / "res.json"
    argv = [str(mask_dir), "--lengths", "40", "56", "--samples", "1", "--kinds", "passkey", "--methods", "full",
            "leank", "--seed", "0", "--no-kl", "--plot", str(plot), "--json", str(out), "--card"]
    assert leank(["eval", *argv]) == 0
    res = json.loads(out.read_text())
    assert set(res["accuracy"]) == {"full", "leank"} and set(res["accuracy"]["leank"]) == {"40", "56"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (mask_dir / "acc.png").is_file()
    card = (mask_dir / "README.md").read_text()
    assert "accuracy (leank)" in card and "![acc.png](acc.png)" in card
    # a later figure-only card write (e.g. a ratio sweep) keeps the results table
    from leank_infer.hub.card import write_model_card

    write_model_card(mask_dir, figures={"other.png": "leank eval x y"})
    card = (mask_dir / "README.md").read_text()
    assert "accuracy (leank)" in card and "![acc.png](acc.png)" in card and "<code>leank eval x y</code>" in card


def test_baselines_keep_sliding_layers_dense_and_the_masks_metadata():
    """Gemma 2: the baselines leave the mask's dense (sliding) layers whole, spend the learned mask's budget
    on its pruned layers only, keep adapter/overrides, and decode through LeanKModel without a MaskError."""
    from leank_infer.mask import dense_layers_of, model_shape

    model = tiny_model("gemma2")
    dense = dense_layers_of(model.config)
    scores = torch.rand(*model_shape(model.config), generator=torch.Generator().manual_seed(2)) ** 2
    mask = ChannelMask.from_scores(scores, 0.75, 4, dense_layers=dense, sink_size=4, recent_size=8, accumu_size=4,
                                   config_overrides={"attn_logit_softcapping": 2.0})  # fmt: skip
    assert dense == (0,)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    for base in (think_mask(model, ids, mask, window=8), random_mask_like(mask, seed=1)):
        assert base.dense_layers == dense and bool(base.keep[0].all())
        assert int(base.keep[1].sum()) == int(mask.keep[1].sum())  # 25% of layer 1's channels, as learned
        assert base.config_overrides == mask.config_overrides and base.scores is None
        lk = LeanKModel(model, base)
        with torch.no_grad():
            out = lk.generate(ids, max_new_tokens=3, do_sample=False)
        assert out.shape == (1, 43)


def test_think_refuses_layers_its_probe_did_not_see():
    """A pruned layer with no recorded q/k would stay whole and ThinK would outspend LeanK: one clear error."""
    import pytest

    model = tiny_model("llama")
    mask = ChannelMask.from_scores(torch.rand(3, 2, 16, generator=torch.Generator().manual_seed(0)), 0.6, 4)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"layers \[2\]"):
        think_mask(model, ids, mask, window=8)
