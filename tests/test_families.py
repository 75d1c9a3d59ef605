"""Model families beyond Llama/Qwen/Mistral: Gemma 2 (soft-capping, sliding layers), Gemma 3, Phi-3.

For each: a LeanK decode with a pruned mask equals the dense LeanK rule (the student attention over
full K/V) step by step, a short fit trains and exports a mask, and what Gemma's sliding-window
layers keep is the model's own sliding cache.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES, MORE_FAMILIES, documented_recent_from, tiny_config, tiny_model
from transformers.cache_utils import DynamicSlidingWindowLayer

from leank_infer import ChannelMask, LeanKModel, MaskError
from leank_infer.decode.attention import softcapped_attention
from leank_infer.decode.backend import decode_attention
from leank_infer.decode.cache import LeanKLayer
from leank_infer.decode.layout import ChannelGroups, DecodeLayout, DecodeMasks
from leank_infer.decode.torch_decode import torch_decode_attention
from leank_infer.mask import binarize, dense_layers_of
from leank_train.distill.student_attention import StudentState

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
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from leank_train.distill.student_attention import TeacherState, leank_student_attention

    new_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        """The student attention, also keeping each student step's own K/V (a decode step caches them)."""
        if isinstance(kwargs.get("leank_student"), StudentState):
            new_kv[module.layer_idx] = (key, value)
        return leank_student_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("leank_student_rec", recording)
    AttentionMaskInterface.register("leank_student_rec", sdpa_mask)
    impl = model.config._attn_implementation
    model.set_attn_implementation("leank_student_rec")
    try:
        record = TeacherState(kv={})
        out = [model(ids[:, :n_prompt], use_cache=False, leank_student=record).logits[:, -1]]
        context = [record.kv[i] for i in sorted(record.kv)]
        for i, recent in enumerate(recents):
            state = StudentState(
                channel_scale=mask.keep.float(),
                sink_size=mask.sink_size,
                recent_size=recent,
                skip_zero_heads=True,
                dense_layers=frozenset(mask.dense_layers),
                context=context,
            )
            p = n_prompt + i
            logits = model(
                ids[:, p : p + 1], use_cache=False, position_ids=torch.tensor([[p]]), leank_student=state
            ).logits
            out.append(logits[:, -1])
            context = [(torch.cat([k, new_kv[j][0]], 2), torch.cat([v, new_kv[j][1]], 2))
                       for j, (k, v) in enumerate(context)]
        return out
    finally:
        model.set_attn_implementation(impl)


@torch.no_grad()
def leank_steps(lk: LeanKModel, ids: torch.Tensor, steps: int):
    """Greedy LeanK decoding by hand: (all tokens, logits of the prompt's last token and of each
    decoded one, the recent size each decode step must have used, the cache).

    The recent sizes come from the documented rule and the token positions alone, never from
    the cache under test."""
    cache = lk.new_cache()
    logits = [lk(ids, cache=cache).logits[:, -1]]
    m = lk.mask
    recents = []
    for _ in range(steps):
        ids = torch.cat([ids, logits[-1].argmax(-1, keepdim=True)], 1)
        logits.append(lk(ids[:, -1:], cache=cache).logits[:, -1])
        p = ids.shape[1] - 1  # the new token's position: it sees full keys [recent_from, p]
        recent_from = documented_recent_from(p, m.recent_size, m.accumu_size)
        assert m.recent_size <= p - recent_from <= m.recent_size + m.accumu_size
        recents.append(p - recent_from)
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
    if getattr(model.config, "attn_logit_softcapping", None):
        model.set_attn_implementation("eager")  # transformers < 5.20 gives Gemma 2 SDPA, which drops the soft-cap
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
    # a mask that does not name the sliding layer still gets the model's sliding cache there...
    old_style = ChannelMask(keep=mask.keep, ratio=mask.ratio, align=mask.align, **SIZES)
    *_, cache = leank_steps(LeanKModel(model, old_style), prompt(40, seed=2), 1)
    assert isinstance(cache.layers[0], DynamicSlidingWindowLayer)
    # ...and one that prunes it does not fit the model
    keep = mask.keep.clone()
    keep[0, 0, :4] = False
    with pytest.raises(MaskError, match=r"layers \[0\] use sliding-window attention"):
        LeanKModel(model, ChannelMask(keep=keep, ratio=mask.ratio, align=mask.align, **SIZES))


def test_gemma2_softcap_matters_and_is_applied():
    """The tiny Gemma 2's soft-cap changes its logits, so the equalities above would catch a path ignoring it."""
    model = tiny_model("gemma2")
    # transformers' eager soft-caps when told to (the default from 5.20 on; 5.19 gives Gemma 2 SDPA, uncapped)
    model.set_attn_implementation("eager")
    uncapped = copy.deepcopy(model)
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
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


def test_dispatch_honours_softcap():
    """Every backend this process can run soft-caps (the Triton kernel's own check, in the interpreter,
    is tests/test_triton_decode.py::test_softcap_in_the_kernel); the capped output differs from the plain one."""
    g = torch.Generator().manual_seed(1)
    keep = binarize(torch.rand(1, 2, 16, generator=g), 0.5, 4)[0]
    groups = ChannelGroups.from_keep(keep)
    q = torch.randn(1, 4, 1, 16, generator=g) * 3
    hk, hv, tk, tv = (torch.randn(1, 2, n, 16, generator=g) for n in (4, 4, 6, 6))
    mk = [torch.randn(1, len(h), 10, c, generator=g) for h, c in zip(groups.heads, groups.counts, strict=True)]
    mv = torch.randn(1, len(groups.nonzero_order), 10, 16, generator=g)
    layout = DecodeLayout.from_parts(hk, hv, tk, tv, mk, mv, groups, sink_size=4)
    want = torch_decode_attention(q, layout, DecodeMasks(), 0.25, 2.0)
    for backend in ("auto", "torch"):  # CPU tensors: auto is the PyTorch path
        got = decode_attention(q, layout, DecodeMasks(), 0.25, 2.0, backend=backend)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not torch.allclose(torch_decode_attention(q, layout, DecodeMasks(), 0.25), want, atol=1e-3)


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_all_sliding_model_is_refused_for_training(family):
    """Every layer sliding with a window that bites (Mistral v0.1, Phi-3-mini-4k): no global layer, one clear error."""
    from leank_train.distill.module import LeanKDistillation

    model = tiny_model(family, sliding_window=16)
    assert dense_layers_of(model.config) == (0, 1)
    with pytest.raises(MaskError, match="sliding-window"):
        LeanKDistillation.for_model(model, sink_size=4, recent_size=8, align=4)
    with pytest.raises(MaskError, match="no global layer"):
        binarize(torch.rand(2, 2, 16), 0.5, 4, dense_layers=(0, 1))
    # a window as long as the positions never bites (Phi-3-128k): those layers are global
    assert dense_layers_of(tiny_config(family, sliding_window=4096, max_position_embeddings=4096)) == ()


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


# ---- training: every family, and a base model + PEFT adapter ----------------------------------


@pytest.fixture(scope="module")
def datamodule():
    from leank_train.data import NeedleDataModule, load_tokenizer

    dm = NeedleDataModule(min_length=120, max_length=200, length_intervals=2, num_samples=3, seed=0)
    dm.tokenizer = load_tokenizer("embedded")
    dm.setup()
    return dm


def _fit(module, datamodule, tmp_path, steps: int = 2):
    import lightning as L

    from leank_train.export import ExportMask

    export = ExportMask(dirpath=str(tmp_path / "mask"), recent_size=8, accumu_size=4)
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, callbacks=[export], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == steps
    return ChannelMask.from_dir(tmp_path / "mask")


TRAIN = dict(sink_size=4, recent_size=8, align=4, ratio=0.5, lr=0.2, reg_weight=0.5, warmup_steps=1)


@pytest.mark.filterwarnings(r"ignore:Found \d+ module\(s\) in eval mode")
@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_train_export_and_decode(family, datamodule, tmp_path):
    """A short fit learns alpha on the global layers only, exports a mask, and that mask decodes like the rule."""
    from leank_train.distill.module import LeanKDistillation

    model = tiny_model(family, vocab_size=49152)  # the embedded tokenizer's vocabulary
    module = LeanKDistillation.for_model(model, **TRAIN)
    ids = prompt(90, seed=4)
    teacher, student = module.hidden_states(ids, 80)  # alpha = 1: the student is the teacher
    torch.testing.assert_close(student, teacher, atol=2e-5, rtol=1e-5)

    mask = _fit(module, datamodule, tmp_path)
    dense = dense_layers_of(model.config)
    alpha = module.alpha.detach()
    pruned = [i for i in range(alpha.shape[0]) if i not in dense]
    assert bool((alpha[list(dense)] == 1).all()) and bool((alpha[pruned] < 1).any())
    assert mask.dense_layers == dense and bool(mask.keep[list(dense)].all())
    assert not bool(mask.keep[pruned].all())
    torch.testing.assert_close(mask.scores, alpha)

    ids, got, recents, _ = leank_steps(LeanKModel(module.llm, mask), prompt(40, seed=5), 6)
    for a, b in zip(got, reference_steps(module.llm, ids, 40, mask, recents), strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def _lora_adapter(base, folder, **save_kw):
    """A tiny random LoRA on every attention projection (lora_B random, so it changes the outputs), saved."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    peft_model = get_peft_model(copy.deepcopy(base), config)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    peft_model.save_pretrained(folder, **save_kw)
    return peft_model.eval()


@pytest.mark.filterwarnings(r"ignore:Found \d+ module\(s\) in eval mode")
def test_lora_adapter_train_export_load_decode(datamodule, tmp_path):
    """A recipe naming base model + adapter learns on the adapted model; from_pretrained loads the same pair."""
    import json

    from leank_train.distill.module import LeanKDistillation

    base = tiny_model("llama", vocab_size=49152)
    base.save_pretrained(tmp_path / "base")
    datamodule.tokenizer.save_pretrained(tmp_path / "base")
    adapted = _lora_adapter(base, tmp_path / "lora")
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file()

    module = LeanKDistillation(base_model=str(tmp_path / "base"), adapter=str(tmp_path / "lora"), **TRAIN)
    mask = _fit(module, datamodule, tmp_path)
    with torch.no_grad():  # what was trained on is the adapted model
        torch.testing.assert_close(module.llm(prompt(30)).logits, adapted(prompt(30)).logits, atol=1e-4, rtol=1e-4)
    assert (mask.adapter, mask.adapter_revision) == (str(tmp_path / "lora"), None)
    assert json.loads((tmp_path / "mask" / "config.json").read_text())["format_version"] == 2

    lk = LeanKModel.from_pretrained(tmp_path / "mask")
    assert lk.tokenizer is not None and type(lk.model).__name__ == "LlamaForCausalLM"  # merged: a plain model
    ids = prompt(40, seed=6)
    with torch.no_grad():
        want, plain = adapted(ids).logits, base(ids).logits
        got = lk(ids).logits  # no LeanK cache: the dense adapted model
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, plain, atol=1e-2)  # the adapter changes the model

    out, logits, recents, _ = leank_steps(lk, ids, 6)
    for a, b in zip(logits, reference_steps(lk.model, out, 40, mask, recents), strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    _, base_logits, _, _ = leank_steps(LeanKModel(base, mask), ids, 6)
    assert not torch.allclose(base_logits[-1], logits[-1], atol=1e-2)  # decoding the base model differs


def test_pickled_or_prompt_learning_adapters_are_refused(tmp_path):
    """Adapter weights only as a pickle are never loaded; prefix/prompt tuning (virtual tokens) cannot merge."""
    from peft import PromptTuningConfig, get_peft_model

    from leank_infer import BaseModelError
    from leank_infer.model.loading import apply_adapter

    base = tiny_model("llama")
    _lora_adapter(base, tmp_path / "lora", safe_serialization=False)
    assert (tmp_path / "lora" / "adapter_model.bin").is_file()
    with pytest.raises(BaseModelError, match="safetensors"):
        apply_adapter(base, tmp_path / "lora")
    prompt_tuned = get_peft_model(copy.deepcopy(base), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    prompt_tuned.save_pretrained(tmp_path / "prompt")
    with pytest.raises(BaseModelError, match="prompt-learning"):
        apply_adapter(base, tmp_path / "prompt")


def test_masks_without_adapter_fields_stay_version_1(tmp_path):
    """Old readers keep reading masks that name no adapter; a mask with an adapter is version 2 (old readers refuse it)."""
    import json

    mask = ChannelMask.full(2, 2, 16, **SIZES)
    cfg = json.loads((mask.save_pretrained(tmp_path / "old") / "config.json").read_text())
    assert cfg["format_version"] == 1 and "adapter" not in cfg and "dense_layers" not in cfg
    loaded = ChannelMask.from_dir(tmp_path / "old")
    assert loaded.adapter is None and loaded.adapter_revision is None and loaded.dense_layers == ()
    mask.adapter, mask.adapter_revision = "org/lora", "abc123"
    back = ChannelMask.from_dir(mask.save_pretrained(tmp_path / "new"))
    assert (back.adapter, back.adapter_revision) == ("org/lora", "abc123")
    with pytest.raises(MaskError, match="adapter_revision"):
        ChannelMask(keep=mask.keep, ratio=0.0, align=1, adapter_revision="abc123")


def test_recipe_names_an_adapter(capsys):
    """``adapter`` / ``adapter_revision`` are recipe keys, overridable on the command line, passed to the model."""
    import yaml

    from leank_train.cli import run_cli
    from leank_train.pipeline import load_recipe
    from leank_train.recipe import stage_config

    recipe = load_recipe(Path(__file__).parent.parent / "recipes" / "smollm2-135m.yaml",
                         ["--adapter", "org/my-lora", "--adapter_revision", "v1"])
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", yaml.safe_dump(stage_config(recipe, 1)), "--print_config"])
    cfg = yaml.safe_load(capsys.readouterr().out)["model"]
    assert (cfg["adapter"], cfg["adapter_revision"]) == ("org/my-lora", "v1")


@pytest.mark.filterwarnings(r"ignore:Found \d+ module\(s\) in eval mode")
def test_config_overrides_train_export_load(datamodule, tmp_path):
    """A mask trained on a YaRN-extended base model records the override, and from_pretrained
    decodes the model it was learned on (not the base model's own RoPE)."""
    from leank_train.distill.module import LeanKDistillation

    base = tiny_model("llama", vocab_size=49152)
    base.save_pretrained(tmp_path / "base")
    datamodule.tokenizer.save_pretrained(tmp_path / "base")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 10000.0}
    module = LeanKDistillation(
        base_model=str(tmp_path / "base"), config_overrides={"rope_parameters": yarn}, **TRAIN
    )
    mask = _fit(module, datamodule, tmp_path)
    assert mask.config_overrides == {"rope_parameters": yarn}
    lk = LeanKModel.from_pretrained(tmp_path / "mask")
    ids = prompt(40, seed=7)
    with torch.no_grad():
        want, plain = module.llm(ids).logits, base(ids).logits
        got = lk(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-3)  # YaRN changes the model
