"""The committed hub/ masks: they load with their base model (the embedded SmolLM2), decode with a pruned
cache, and the 0.7 mask answers unseen passkey probes that the random and ThinK masks at its budget miss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from leank_infer import ChannelMask, LeanKModel

HUB = Path(__file__).resolve().parent.parent / "hub"
# the committed masks of the embedded model (the imported Llama / Qwen ones are decoded at their real shapes
# in tests/test_reference_masks.py, without weights)
MASKS = sorted(
    p.name for p in HUB.iterdir()
    if (p / "mask.safetensors").is_file() and json.loads((p / "config.json").read_text()).get("loader", {}).get("embedded")
)

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings(r"ignore:Found \d+ module\(s\) in eval mode")]


@pytest.fixture(scope="module")
def lm70(embedded) -> LeanKModel:
    model, tok = embedded
    return LeanKModel(model, ChannelMask.from_pretrained(HUB / "smollm2-135m-instruct"), tok)


def test_there_are_committed_masks():
    assert {"smollm2-135m-instruct", "smollm2-135m-instruct-r80"} <= set(MASKS)


@pytest.mark.parametrize("name", MASKS)
def test_committed_mask_loads_and_decodes_with_a_pruned_cache(name, embedded):
    model, tok = embedded
    mask = ChannelMask.from_pretrained(HUB / name)
    assert mask.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and mask.loader.get("embedded")
    lk = LeanKModel(model, mask, tok)  # validates the mask against the model
    assert abs(mask.stats()["k_kept_fraction"] - (1 - mask.ratio)) < 0.05
    text = " ".join(f"Item {i} is {(i * 37) % 101}." for i in range(40)) + " What is item 7?"
    enc = tok(text, return_tensors="pt")
    n = enc["input_ids"].shape[1]
    cache = lk.new_cache()
    out = lk.generate(**enc, max_new_tokens=8, do_sample=False, cache=cache)
    assert out.shape[1] == n + 8 and tok.decode(out[0, n:], skip_special_tokens=True).strip()
    assert cache.region_lengths()["middle"] > 0
    assert cache.nbytes() < (n + 7) * mask.kv_bytes_per_token(torch.float32)["dense"]


def test_learned_mask_beats_random_and_think_on_fixed_probes(lm70):
    """Two unseen 1k-token passkey probes (seed 0): the full model and the learned 0.7 mask answer both;
    a random mask with the same per-head counts and ThinK at the same budget answer neither."""
    from leank_train.evaluate import evaluate

    res = evaluate(lm70, lengths=[1024], samples=2, kinds=["passkey"], seed=0, kl=False, max_new_tokens=16)
    acc = {m: res["accuracy"][m][1024] for m in ("full", "leank", "random", "think")}
    assert acc["leank"] == acc["full"] == 1.0, res["answers"]
    assert acc["random"] < acc["leank"] and acc["think"] < acc["leank"], res["answers"]
