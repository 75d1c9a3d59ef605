"""Scaling out on CPU with gloo: DDP and sequence parallelism equal the single process; activation checkpointing.

One ``torchrun`` launch of ``tests/dist_driver.py`` (2 processes) runs three Lightning fits of a tiny
random Llama saved to disk: DDP 2 x batch 1, sequence-parallel (both ranks split one sample), and
sequence-parallel with activation checkpointing; the single-process references run in this process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import dist_driver
import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file, save_file

from leank_train.data import collate_needles, load_tokenizer
from leank_train.distill.module import LeanKDistillation

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama + the embedded tokenizer, and start scores where distillation has a gradient."""
    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", vocab_size=49152).save_pretrained(path)
    load_tokenizer("embedded").save_pretrained(path)
    scores = 0.2 + 0.7 * torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(3))
    save_file({"scores": scores}, str(path / "scores.safetensors"))
    return path


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Per run name, the per-rank results of the 2-process torchrun launch."""
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(ROOT / "tests" / "dist_driver.py"), str(model_dir), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = ("ddp", "sp", "sp-ckpt", "exchange")
    return {n: [load_file(str(out / f"{n}-rank{r}.safetensors")) for r in range(2)] for n in names}


@pytest.fixture(scope="module")
def single(model_dir, tmp_path_factory, runs) -> dict[str, dict[str, torch.Tensor]]:
    """Single-process references: batch 2 (for DDP) and batch 1 (for sequence parallelism), 3 steps each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("single")
    kw = {"init_scores": str(model_dir / "scores.safetensors")}
    try:
        return {
            "b2": dist_driver.fit_and_record(str(model_dir), out, "b2", batch_size=2, **kw),
            "b1": dist_driver.fit_and_record(str(model_dir), out, "b1", batch_size=1, **kw),
        }
    finally:
        torch.set_num_threads(threads)


def test_ddp_two_processes_batch1_equal_one_process_batch2(runs, single):
    ref = single["b2"]
    assert (ref["alpha"] - 1).abs().max() > 1e-2  # training moved alpha: the comparison means something
    ranks = runs["ddp"]
    assert torch.equal(ranks[0]["alpha"], ranks[1]["alpha"])  # scalers identical on every rank
    for r in ranks:
        assert int(r["sp_size"]) == 1
        torch.testing.assert_close(r["alpha"], ref["alpha"], atol=1e-6, rtol=0)
        # the first step's synced gradient: distillation averaged over the global batch, reg counted once
        torch.testing.assert_close(r["grad0"], ref["grad0"], atol=1e-9, rtol=1e-5)
    # each rank's loss is its own sample's distillation + reg; their mean is the batch-2 loss
    torch.testing.assert_close((ranks[0]["loss0"] + ranks[1]["loss0"]) / 2, ref["loss0"], atol=1e-7, rtol=1e-6)
    assert not torch.equal(ranks[0]["loss0"], ranks[1]["loss0"])  # the ranks saw different samples


def test_sequence_parallel_equals_one_process(runs, single):
    ref = single["b1"]
    ranks = runs["sp"]
    assert torch.equal(ranks[0]["alpha"], ranks[1]["alpha"])
    for r in ranks:
        assert int(r["sp_size"]) == 2  # the sequence really was split over the two ranks
        torch.testing.assert_close(r["loss0"], ref["loss0"], atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(r["grad0"], ref["grad0"], atol=1e-8, rtol=1e-4)
        torch.testing.assert_close(r["alpha"], ref["alpha"], atol=1e-5, rtol=0)


def test_sequence_parallel_with_activation_checkpointing(runs, single):
    for r in runs["sp-ckpt"]:
        torch.testing.assert_close(r["grad0"], single["b1"]["grad0"], atol=1e-8, rtol=1e-4)


def test_ulysses_exchange_is_a_transpose_of_shards(runs):
    assert all(int(r["ok"]) == 1 for r in runs["exchange"])


def _count_attention_calls(module: LeanKDistillation) -> list[int]:
    calls = [0]
    module.llm.get_decoder().layers[0].self_attn.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_activation_checkpointing_same_gradients(one_thread, tmp_path):
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(0))
    grads, calls = [], []
    for ckpt in (False, True):
        module = LeanKDistillation.for_model(tiny_model("llama"), sink_size=4, recent_size=8, align=4,
                                             activation_checkpointing=ckpt)
        with torch.no_grad():
            module.alpha.uniform_(0.2, 0.9, generator=torch.Generator().manual_seed(1))
        count = _count_attention_calls(module)
        teacher, student = module.hidden_states(ids, 70)
        (teacher - student).pow(2).mean().backward()
        grads.append(module.alpha.grad.clone())
        calls.append(count[0])
        assert not module.llm.training and not any(m.training for m in module.llm.modules())
    torch.testing.assert_close(grads[1], grads[0], atol=0, rtol=1e-6)
    assert grads[0].abs().sum() > 0
    # teacher + student = 2 calls of a layer's attention; checkpointing replays the student's in the backward
    assert calls == [2, 3]


def test_batch_is_the_mean_of_its_samples_and_reg_counts_once(one_thread):
    module = LeanKDistillation.for_model(tiny_model("llama"), sink_size=4, recent_size=8, align=4, reg_weight=0.5)
    with torch.no_grad():
        module.alpha.uniform_(0.2, 0.9, generator=torch.Generator().manual_seed(1))
    rows = []
    for n, ctx, seed in ((60, 50, 0), (75, 66, 1)):
        ids = torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * ctx + ids[ctx:], "context_len": ctx})
    batch = collate_needles(rows)
    assert batch["input_ids"].shape == (2, 75) and batch["length"].tolist() == [60, 75]
    assert (batch["labels"][0, 60:] == -100).all() and (batch["input_ids"][0, 60:] == 0).all()
    distill, reg = module.losses(batch)
    singles = [module.losses(collate_needles([r]))[0] for r in rows]
    torch.testing.assert_close(distill, (singles[0] + singles[1]) / 2)
    torch.testing.assert_close(reg, 0.5 * module.alpha.abs().mean())


def test_sequence_parallel_strategy_rejects_bad_sizes():
    from leank_train.sequence_parallel import SequenceParallelStrategy, check_divisible

    with pytest.raises(ValueError, match="sequence_parallel_size"):
        SequenceParallelStrategy(0)
    with pytest.raises(ValueError, match="KV heads divisible by 4"):
        check_divisible(2, 4, "the KV heads")


def test_memory_estimate_terms():
    from leank_train.memory import count_params, estimate_step_memory, known_config

    for family in ("llama", "qwen2"):
        model = tiny_model(family)
        assert count_params(model.config) == sum(p.numel() for p in model.parameters())
    cfg = known_config("meta-llama/Llama-3.1-8B-Instruct")  # the published architecture, offline
    assert 7.9e9 < count_params(cfg) < 8.1e9
    one = estimate_step_memory(cfg, 32768)
    assert one["kv_bytes_per_token_per_layer"] == 2 * 8 * 128 * 2
    two = estimate_step_memory(cfg, 32768, sequence_parallel=2)
    assert two["context_kv_gib"] == pytest.approx(one["context_kv_gib"] / 2)
    assert estimate_step_memory(cfg, 32768, activation_checkpointing=False)["student_saved_gib"] > 10 * one["student_saved_gib"]
    with pytest.raises(ValueError, match="divide"):
        estimate_step_memory(cfg, 32768, sequence_parallel=3)
