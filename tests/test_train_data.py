"""The needle data: seeded, labels only on the answer, lengths on the grid, pluggable haystacks/templates."""

from __future__ import annotations

import pytest
import torch

from leank_train.data import NeedleDataModule, NeedleTemplate, essay_text, haystack_text, length_grid


@pytest.fixture(scope="module")
def tokenizer():
    from leank_train.data import load_tokenizer

    return load_tokenizer("embedded")


def _dm(tokenizer, **kwargs) -> NeedleDataModule:
    kwargs = {"min_length": 200, "max_length": 600, "length_intervals": 4, "num_samples": 6, **kwargs}
    dm = NeedleDataModule(**kwargs)
    dm.tokenizer = tokenizer
    return dm


def test_same_seed_same_samples_other_seed_other_samples(tokenizer):
    a = _dm(tokenizer, seed=3).build_dataset()
    b = _dm(tokenizer, seed=3).build_dataset()
    c = _dm(tokenizer, seed=4).build_dataset()
    assert a["input_ids"] == b["input_ids"]
    assert a["input_ids"] != c["input_ids"]


def test_labels_are_exactly_the_answer_after_the_assistant_turn(tokenizer):
    dm = _dm(tokenizer, num_samples=8)
    dm.setup()
    for row in dm.train_set:
        ids, labels, ctx = row["input_ids"], row["labels"], int(row["context_len"])
        assert (labels[:ctx] == -100).all()
        assert torch.equal(labels[ctx:], ids[ctx:])
        prompt = tokenizer.decode(ids[:ctx])
        answer = tokenizer.decode(ids[ctx:])
        assert prompt.endswith("<|im_start|>assistant\n")
        assert answer.startswith("The special magic") and answer.endswith(".")
        # the answered value is in the context
        value = answer.rstrip(".").split()[-1]
        assert value in prompt


def test_prompt_lengths_follow_the_grid(tokenizer):
    grid = length_grid(200, 600, 4)
    assert grid == [200, 300, 400, 500, 600]
    ds = _dm(tokenizer, num_samples=12).build_dataset()
    lengths = [row["context_len"] for row in ds]
    # built sentence by sentence to the grid length: within a sentence of it, and spread over the grid
    assert all(150 <= n <= 700 for n in lengths)
    assert max(lengths) - min(lengths) > 150


def test_training_loader_is_one_sequence_per_batch(tokenizer):
    dm = _dm(tokenizer)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and batch["labels"].shape == batch["input_ids"].shape
    assert batch["context_len"].shape == (1,)


def test_custom_haystack_file_and_template(tokenizer, tmp_path):
    text = tmp_path / "story.txt"
    text.write_text("Zebras gallop across the quiet plain at dawn. " * 200)
    template = NeedleTemplate(
        kind="multikey",
        noun="codes",
        needle="The secret code of {key} is {value}.",
        question="Which secret code belongs to {key}?",
        answer="The secret code of {key} is {value}.",
        num_keys=2,
    )
    ds = _dm(tokenizer, haystacks=[str(text)], templates=[template], num_samples=3).build_dataset()
    for row in ds:
        prompt = tokenizer.decode(row["input_ids"][: row["context_len"]])
        assert "Zebras gallop" in prompt and "The grass is green" not in prompt
        assert prompt.count("The secret code of") == 2
        assert row["answer"].startswith("The secret code of")


def test_builtin_haystacks_need_no_download():
    essay = essay_text()
    assert len(essay) > 50_000 and "::=" not in essay
    assert haystack_text("noise").startswith("The grass is green.")
