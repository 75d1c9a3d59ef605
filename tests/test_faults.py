"""Issue #10, faults and bad input: resume after kill -9, NaN/inf stops, and bad inputs fail once and clearly.

Covered elsewhere (not repeated here): atomic export (test_train_fit::test_stage2_starts_from_stage1_folder,
test_mask::test_failed_save_leaves_nothing), a stage 2 without ``init_scores`` (test_train_fit::
test_stage2_needs_scores), truncated files and shape/config mismatches (test_mask::test_truncated_safetensors,
test_shape_disagrees_with_config, test_mask_fuzz), a mask for another model (test_model::
test_mismatched_mask_is_refused_before_touching_the_model, test_from_pretrained_with_model_checks_shape_and_base_model),
an empty prompt (test_generate_cli::test_empty_prompt_is_one_clear_error).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from conftest import tiny_model
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file, save_file

from leank_infer.mask import MASK_FILE, ChannelMask, MaskError
from leank_train.data import DEFAULT_TEMPLATES, NOISE, NeedleDataModule
from leank_train.distill.finite import NonFiniteError
from leank_train.distill.module import LeanKDistillation

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings(r"ignore:Found \d+ module\(s\) in eval mode"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:.*there is no last checkpoint available"),
    pytest.mark.filterwarnings("ignore:You.re resuming from a checkpoint that ended before the epoch ended"),
]

ROOT = Path(__file__).resolve().parent.parent


# ---- a tiny base model folder and a tiny recipe -------------------------------------------------------
def base_model(folder: Path, chat: bool = True, **config) -> Path:
    """A saved 2-layer random Llama with a word-level tokenizer over the noise haystack and the templates."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    text = " ".join([NOISE, *(f"{t.intro} {t.needle} {t.question} {t.answer}" for t in DEFAULT_TEMPLATES)])
    words = sorted(set(re.findall(r"\w+|[^\w\s]+", text)))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    if chat:
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}:"
    tiny_model("llama", vocab_size=len(vocab), **config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def recipe(folder: Path, base: Path, extra: dict | None = None) -> Path:
    """A two-stage flat recipe over ``base`` that runs in seconds; ``extra`` is merged into it (dicts deeply).

    Stage 1 exports to ``folder/stage1``, stage 2 to ``folder/final``; checkpoints go to ``folder/runs``.
    """
    cfg = {
        "out_dir": str(folder / "runs"),
        "stage1_dir": str(folder / "stage1"),
        "mask_dir": str(folder / "final"),
        "base_model": str(base), "sink_size": 4, "recent_size": 8, "ratio": 0.5, "align": 4, "warmup_steps": 2,
        "haystacks": ["noise"], "min_length": 60, "max_length": 120, "length_intervals": 2, "chat": True,
        "seed": 0, "checkpoint_every": 2,
        "trainer": {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False,
                    "enable_model_summary": False},
        "evaluate": {"enabled": False},
        "stage1": {"steps": 7, "lr": 0.05, "reg_weight": 0.5, "num_samples": 4, "seed": 0},
        "stage2": {"steps": 5, "lr": 0.02, "reg_weight": 0.0, "num_samples": 4, "seed": 1},
    }

    def merge(a: dict, b: dict) -> None:
        for k, v in b.items():
            if isinstance(v, dict) and isinstance(a.get(k), dict):
                merge(a[k], v)
            else:
                a[k] = v

    merge(cfg, extra or {})
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return base_model(tmp_path_factory.mktemp("base") / "tiny-llama")


class PauseOnce(L.Callback):
    """Test helper: at ``step`` of ``stage`` (after that step's checkpoint), write ``marker`` and hang.

    Only the first time (the marker exists afterwards), so rerunning the very same command goes on.
    """

    def __init__(self, stage: int, step: int, marker: str) -> None:
        self.stage, self.step, self.marker = stage, step, marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if pl_module.hparams.stage == self.stage and trainer.global_step == self.step:
            if not os.path.exists(self.marker):
                Path(self.marker).write_text(str(trainer.global_step))
                time.sleep(600)


def written(folder: Path) -> list[str]:
    """Everything under ``folder`` except the recipe the test wrote."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.name != "recipe.yaml")


# ---- resume: kill -9 mid-stage, rerun the same command --------------------------------------------------
def test_kill_9_then_rerun_equals_an_uninterrupted_run(base, tmp_path, capsys):
    from leank_infer.cli import main

    # the same recipe plus a callback that hangs once mid-stage 2 (after the step-2 checkpoint)
    marker = tmp_path / "run" / "paused"
    pause = {"class_path": "test_faults.PauseOnce", "init_args": {"stage": 2, "step": 2, "marker": str(marker)}}
    run = recipe(tmp_path / "run", base, {"stage2": {"trainer": {"callbacks": [pause]}}})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "leank_infer.cli", "run", str(run)]
    with (tmp_path / "first.log").open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        # meanwhile the reference: one uninterrupted run of the recipe without the callback, in this process
        ref = recipe(tmp_path / "ref", base)
        assert main(["run", str(ref)]) == 0

        deadline = time.monotonic() + 180
        while not marker.exists():
            assert proc.poll() is None, (tmp_path / "first.log").read_text()
            assert time.monotonic() < deadline, "the run never reached stage 2, step 2"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert ChannelMask.from_dir(tmp_path / "run" / "stage1").scores is not None  # stage 1 had finished
    assert not (tmp_path / "run" / "final").exists()  # stage 2 had not
    assert list((tmp_path / "run" / "runs" / "checkpoints" / "stage2").glob("*/last.ckpt"))
    stage1_mtime = (tmp_path / "run" / "stage1" / MASK_FILE).stat().st_mtime_ns

    # the same command again (in this process: the same code, without a second interpreter start):
    # stage 1 is skipped, stage 2 resumes from its last checkpoint
    capsys.readouterr()
    assert main(["run", str(run)]) == 0
    out = capsys.readouterr().out
    assert "stage 1 already done" in out
    assert re.search(r"stage 2 resumes from .*last\.ckpt", out)
    assert (tmp_path / "run" / "stage1" / MASK_FILE).stat().st_mtime_ns == stage1_mtime

    for name in ("stage1", "final"):
        want, got = load_file(tmp_path / "ref" / name / MASK_FILE), load_file(tmp_path / "run" / name / MASK_FILE)
        assert set(got) == {"keep", "scores"}
        for key in got:
            assert torch.equal(got[key], want[key]), (name, key)
    train = [json.loads((tmp_path / d / "final" / "config.json").read_text())["extra"]["training"]
             for d in ("ref", "run")]
    assert train[0] == train[1]  # same steps, same last-10-steps loss


def test_rerun_skips_finished_stages_and_new_settings_start_afresh(base, tmp_path, capsys):
    from leank_infer.cli import main

    path = str(recipe(tmp_path, base))
    assert main(["run", path]) == 0
    capsys.readouterr()
    final = (tmp_path / "final" / MASK_FILE).stat().st_mtime_ns

    assert main(["run", path]) == 0  # everything done: both stages skipped, nothing rewritten
    out = capsys.readouterr().out
    assert "stage 1 already done" in out and "stage 2 already done" in out
    assert (tmp_path / "final" / MASK_FILE).stat().st_mtime_ns == final

    # another stage-2 setting: stage 1 is still done, stage 2 trains afresh (not from the stale checkpoint)
    assert main(["run", path, "--stage2.steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "stage 1 already done" in out and "stage 2 already done" not in out and "resumes" not in out
    assert ChannelMask.from_dir(tmp_path / "final").extra["training"]["steps"] == 3
    assert len(list((tmp_path / "runs" / "checkpoints" / "stage2").iterdir())) == 2  # one folder per setting

    # a damaged export is not "done": the stage runs again (resuming from its final checkpoint) and rewrites it
    (tmp_path / "final" / MASK_FILE).write_bytes(b"garbage")
    assert main(["run", path, "--stage2.steps", "3"]) == 0
    assert "stage 2 resumes from" in capsys.readouterr().out
    assert ChannelMask.from_dir(tmp_path / "final").extra["training"]["steps"] == 3


def _module(base: Path, **kwargs) -> LeanKDistillation:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    kwargs = {"base_model": str(base), "sink_size": 4, "recent_size": 8, "align": 4, "ratio": 0.5,
              "warmup_steps": 2, "lr": 0.05, "reg_weight": 0.5, **kwargs}
    return LeanKDistillation.for_model(model, **kwargs)


def _data(base: Path) -> NeedleDataModule:
    return NeedleDataModule(base_model=str(base), haystacks=["noise"], min_length=60, max_length=120,
                            length_intervals=2, num_samples=4, chat=True)


def _fit(base: Path, ckpt_dir: Path, steps: int, callbacks=(), ckpt_path=None, every: int = 2) -> LeanKDistillation:
    L.seed_everything(0, verbose=False)
    module = _module(base)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every, save_last=True, save_top_k=0)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[checkpoint, *callbacks])
    trainer.fit(module, datamodule=_data(base), ckpt_path=ckpt_path)
    return module


class Crashed(RuntimeError):
    pass


class Crash(L.Callback):
    """Raise at the start of the step after ``step`` (that step's checkpoint is on disk): a crash mid-stage."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise Crashed(f"crash after step {self.step}")


class Seen(L.Callback):
    """Record the first token ids of every batch a fit trains on, with the step."""

    def __init__(self) -> None:
        self.batches: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches[trainer.global_step] = batch["input_ids"][0, -12:].tolist()


# 4 samples per epoch, 9 steps: resume mid-epoch (2, 6), at an epoch end (4, 8) and on the first step's checkpoint
@pytest.mark.parametrize("crash_at", [1, 2, 4, 6, 8])
def test_resume_sees_the_same_batches_and_ends_bit_identical(base, tmp_path, crash_at):
    full_seen = Seen()
    full = _fit(base, tmp_path / "full", 9, [full_seen], every=1 if crash_at == 1 else 2)

    every = 1 if crash_at == 1 else 2
    with pytest.raises(Crashed):
        _fit(base, tmp_path / "crash", 9, [Crash(crash_at)], every=every)
    assert torch.load(tmp_path / "crash" / "last.ckpt", weights_only=True)["global_step"] == crash_at
    seen = Seen()
    resumed = _fit(base, tmp_path / "crash", 9, [seen], ckpt_path="last", every=every)

    assert min(seen.batches) == crash_at
    for step, ids in seen.batches.items():
        assert ids == full_seen.batches[step], step  # the data position after resume is the same
    assert torch.equal(resumed.alpha, full.alpha)
    assert resumed.final_distill_loss == full.final_distill_loss


# ---- NaN / inf ----------------------------------------------------------------------------------------
class NaNLossAt(LeanKDistillation):
    nan_step = 3

    def losses(self, batch):
        distill, reg = super().losses(batch)
        if self.global_step + 1 == self.nan_step:
            distill = distill * float("nan")
        return distill, reg


class NaNGradAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step + 1 == self.step:
            pl_module.alpha.grad.fill_(float("inf"))


@pytest.mark.parametrize("what", ["loss", "alpha"])
def test_non_finite_stops_at_the_step_and_keeps_the_last_good_checkpoint(base, tmp_path, what):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cls = NaNLossAt if what == "loss" else LeanKDistillation
    module = cls.for_model(model, base_model=str(base), sink_size=4, recent_size=8, align=4, ratio=0.5)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last=True, save_top_k=0)
    callbacks = [checkpoint] + ([NaNGradAt(3)] if what == "alpha" else [])
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    pattern = "non-finite loss at step 3" if what == "loss" else r"non-finite channel scalers \(alpha\) at step 3"
    with pytest.raises(NonFiniteError, match=pattern) as err:
        trainer.fit(module, datamodule=_data(base))
    assert "last good checkpoint is" in str(err.value) and "last.ckpt" in str(err.value)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 2 and torch.isfinite(ckpt["state_dict"]["alpha"]).all()
    # it loads: a fresh module resumes from it and trains on (without the fault)
    resumed = _module(base)
    L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False).fit(resumed, datamodule=_data(base), ckpt_path=tmp_path / "last.ckpt")
    assert torch.isfinite(resumed.alpha).all() and resumed.trainer.global_step == 3


# ---- bad inputs: one clear error, nothing written -------------------------------------------------------
def _leank(args: list[str], capsys) -> tuple[int, str]:
    from leank_infer.cli import main

    code = main(args)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"learning_rate": 0.1}, r"learning_rate"),  # unknown key
        ({"stage1": {"num_samples": "many"}}, r"num_samples"),  # wrong type
        ({"trainer": {"max_stepz": 3}}, r"max_stepz"),
        # checkpoints are what a rerun resumes from: turning them off is refused by Lightning, in one line
        ({"trainer": {"enable_checkpointing": False}}, r"enable_checkpointing=False.*ModelCheckpoint"),
    ],
    ids=["unknown-key", "wrong-type", "unknown-trainer-key", "checkpointing-off"],
)
def test_bad_recipe_is_lightningclis_error(base, tmp_path, capsys, extra, message):
    path = recipe(tmp_path, base, extra)
    code, err = _leank(["run", str(path)], capsys)
    assert code == 2 and re.search(message, err), err
    assert "Traceback" not in err
    assert written(tmp_path) == []


def test_context_longer_than_the_model(tmp_path, capsys):
    short = base_model(tmp_path / "short", max_position_embeddings=100)
    path = recipe(tmp_path / "r", short)  # max_length 120
    code, err = _leank(["run", str(path)], capsys)
    assert code == 2
    assert "data.max_length=120 is larger than the 100 positions" in err and "Traceback" not in err
    assert written(tmp_path / "r") == []


def test_chat_recipe_needs_a_chat_template(tmp_path, capsys):
    plain = base_model(tmp_path / "plain", chat=False)
    path = recipe(tmp_path / "r", plain)
    code, err = _leank(["run", str(path)], capsys)
    assert code == 2 and "has no chat template" in err and "data.chat" in err, err
    assert written(tmp_path / "r") == []
    # the same tokenizer trains with data.chat: false (plain prompts)
    dm = NeedleDataModule(base_model=str(plain), haystacks=["noise"], min_length=60, max_length=80, num_samples=1,
                          chat=False)
    dm.setup()
    assert len(dm.train_set) == 1


@pytest.mark.parametrize("haystack", ["{tmp}/missing.txt", "{tmp}/no/such/folder", "./not-here.txt"])
def test_missing_haystack_path(base, tmp_path, capsys, haystack):
    path = recipe(tmp_path, base, {"haystacks": [haystack.format(tmp=tmp_path)]})
    code, err = _leank(["run", str(path)], capsys)
    assert code == 2 and "no such file or folder" in err and "data.haystacks" in err, err
    assert written(tmp_path) == []


def test_stage2_without_stage1_scores_names_the_path(base, tmp_path, capsys):
    path = recipe(tmp_path, base)
    code, err = _leank(["run", str(path), "--stage", "2"], capsys)
    assert code == 2 and f"model.init_scores={tmp_path / 'stage1'} does not exist" in err, err
    assert "run stage 1 first" in err and written(tmp_path) == []


def test_stage2_from_a_mask_without_scores(base, tmp_path):
    mask = ChannelMask.from_scores(torch.rand(2, 2, 16), 0.5, 4)
    mask.scores = None
    mask.save_pretrained(tmp_path / "no-scores")
    with pytest.raises(MaskError, match="holds no 'scores'"):
        _module(base, stage=2, init_scores=str(tmp_path / "no-scores"))


@pytest.mark.parametrize("tamper", ["keep-not-binary", "keep-float", "scores-nan", "scores-shape", "no-keep"])
def test_tampered_mask_file(tmp_path, tamper):
    ChannelMask.from_scores(torch.rand(2, 2, 16), 0.5, 4).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / MASK_FILE)
    if tamper == "keep-not-binary":
        tensors["keep"][0, 0, 0] = 2
    elif tamper == "keep-float":
        tensors["keep"] = tensors["keep"].float()
    elif tamper == "scores-nan":
        tensors["scores"][1, 1, 3] = float("nan")
    elif tamper == "scores-shape":
        tensors["scores"] = tensors["scores"][:, :, :8].contiguous()
    else:
        tensors["kept"] = tensors.pop("keep")
    save_file(tensors, tmp_path / MASK_FILE)
    pattern = {"keep-not-binary": "0 and 1", "keep-float": "uint8", "scores-nan": "NaN",
               "scores-shape": "scores has shape", "no-keep": "no tensor named 'keep'"}[tamper]
    with pytest.raises(MaskError, match=pattern):
        ChannelMask.from_pretrained(tmp_path)


def test_config_overrides_are_checked_before_training():
    from leank_train.distill.module import LeanKDistillation
    from leank_train.errors import RecipeError

    with pytest.raises(RecipeError, match="model.config_overrides must be a JSON object"):
        LeanKDistillation(config_overrides=["rope_parameters"])
