"""The reference release's masks: ``leank import``, the committed hub folders, and decoding / training
at the real shapes of Llama-3.1-8B-Instruct and Qwen2.5-7B-Instruct without downloading weights.

The configurations below are written out from the models' published ``config.json`` (random weights).
What is shrunk, and why it leaves the attention as the real model's:

- MLP width and vocabulary (they do not touch attention);
- layers: the decode tests build 2 layers and slice the same 2 layers out of the 32/28-layer mask
  (``LAYERS``; chosen to hold zero-channel heads and kept counts 32, 64 and 96; Qwen's layer 0 keeps
  no channel in any head). The full-depth configurations are checked on the meta device (shape, mask fit,
  parameter count);
- ``test_real_decode_at_reference_sizes`` keeps the real hidden size and the mask's real sizes
  (sink 128, recent 768, accumulation 128: prompts of ~1k tokens, fp32);
- the padded-batch, bf16 and training tests also shrink hidden_size to 256 while keeping ``head_dim`` 128
  explicit: q/k/v/o still produce the real 32 (28) query heads and 8 (4) KV heads of 128 channels, rope
  (llama3 scaling, theta) is the real one; the sink/recent/accumulation sizes are scaled to 16/64/16 so that
  compressions happen within a few dozen tokens (bf16 matmuls on CPUs without bf16 units are ~7x slower
  than fp32, which rules out 4096-wide bf16 prefills of 1k tokens in a unit test).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import documented_recent_from
from test_families import reference_steps

from leank_infer import ChannelMask, LeanKModel
from leank_infer.cli import main as cli
from leank_infer.mask import MaskError, dense_layers_of, model_shape
from leank_infer.mask.capacity import GiB, capacity_rows, capacity_table, sequence_kv_bytes
from leank_infer.reference_import import KNOWN_RELEASES, REFERENCE_SIZES, import_reference_mask

ROOT = Path(__file__).resolve().parents[1]
# The reference release's files (not in the repo: pickles are not committed): beside the checkout as
# ../shared/reference-masks (the project's layout), or where LEANK_REFERENCE_MASKS points.
SHARED = next(
    (p for p in (Path(os.environ.get("LEANK_REFERENCE_MASKS", "/nonexistent")), *(r / "shared" / "reference-masks"
     for r in ROOT.parents)) if (p / "README.md").is_file()),
    ROOT.parent / "shared" / "reference-masks",
)  # fmt: skip
HUB = {"llama": ROOT / "hub" / "llama-3.1-8b-instruct", "qwen2": ROOT / "hub" / "qwen2.5-7b-instruct"}
PTH = {"llama": "llama3.1-8b-instruct.pth", "qwen2": "qwen2.5-7b-instruct.pth"}

# Published configurations (config.json of each Hub repo).
LLAMA_3_1_8B = dict(
    model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, vocab_size=128256,
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009],
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)  # fmt: skip
QWEN2_5_7B = dict(
    model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6, vocab_size=152064,
    tie_word_embeddings=False, use_sliding_window=False, sliding_window=131072, max_window_layers=28,
    bos_token_id=151643, eos_token_id=151645, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)  # fmt: skip
REAL = {"llama": LLAMA_3_1_8B, "qwen2": QWEN2_5_7B}
LAYERS = {"llama": [2, 10], "qwen2": [0, 22]}
SMALL_SIZES = dict(sink_size=16, recent_size=64, accumu_size=16)


def real_config(family: str, **shrink):
    from transformers import AutoConfig

    fields = {**REAL[family], **shrink}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def shrunk_model(family: str, dtype: torch.dtype, hidden: int | None = None, seed: int = 0, vocab: int = 512):
    """The real configuration with 2 layers, MLP width 64, vocabulary ``vocab`` (and hidden_size ``hidden``), random."""
    from transformers import AutoModelForCausalLM

    shrink = dict(num_hidden_layers=2, intermediate_size=64, vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)  # fmt: skip
    if hidden:
        shrink["hidden_size"] = hidden
    if family == "qwen2":
        shrink["max_window_layers"] = 2
    cfg = real_config(family, **shrink)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def sliced_mask(family: str, **sizes) -> ChannelMask:
    """The committed mask, restricted to ``LAYERS[family]`` (its own sizes unless ``sizes`` are given)."""
    full = ChannelMask.from_dir(HUB[family])
    meta = dict(sink_size=full.sink_size, recent_size=full.recent_size, accumu_size=full.accumu_size)
    meta.update(sizes)
    return ChannelMask(keep=full.keep[LAYERS[family]], ratio=full.ratio, align=full.align, **meta)


# ---- the committed folders and the import command --------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_full_configs_fit_the_committed_masks(family):
    """The masks fit the full-depth real configs; the recorded parameter counts are those configs' (meta device)."""
    from transformers import AutoModelForCausalLM

    from leank_train.memory import KNOWN_CONFIGS, count_params

    cfg = real_config(family)
    mask = ChannelMask.from_dir(HUB[family])
    mask.validate(cfg)
    assert dense_layers_of(cfg) == ()  # every layer is global: LeanK prunes all of them
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())
    assert params == mask.extra["base_model_parameters"] == count_params(cfg)
    assert params == KNOWN_RELEASES[mask.extra["provenance"]["sha256"]]["base_model_parameters"]
    known = KNOWN_CONFIGS[mask.base_model]  # leank_train.memory's offline copy agrees with the published config
    assert {k: v for k, v in REAL[family].items() if k in known} == known
    LeanKModel(model, mask)  # shape check against the real model passes (no weights needed)
    if family == "llama":
        assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.max_position_embeddings == 131072


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_committed_folder_is_what_import_writes(family, tmp_path):
    """hub/<model> is exactly `leank import` of the shared file (mask, config, licence, card)."""
    src = SHARED / PTH[family]
    if not src.is_file():
        pytest.skip(f"{src} is not on this machine")
    out = tmp_path / HUB[family].name
    repo = f"hub/{HUB[family].name}"
    assert cli(["import", str(src), str(out), "--repo", repo]) == 0
    for name in ("config.json", "LICENSE", "README.md"):
        assert (out / name).read_text() == (HUB[family] / name).read_text(), name
    assert (out / "pattern.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    mask = ChannelMask.from_dir(HUB[family])
    want = torch.load(src, weights_only=True)
    assert torch.equal(mask.keep, want.bool())
    assert (mask.sink_size, mask.recent_size, mask.accumu_size) == (128, 768, 128) == tuple(REFERENCE_SIZES.values())
    assert mask.ratio == pytest.approx(1 - float(want.mean()), abs=1e-6) and mask.align == 32
    assert (mask.kept_counts % 32 == 0).all()
    assert (HUB[family] / "LICENSE").read_text() == (SHARED / "LICENSE").read_text()
    assert "Copyright (c) Microsoft Corporation" in (HUB[family] / "LICENSE").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cards_say_what_was_measured_and_what_was_reported(family):
    card = (HUB[family] / "README.md").read_text()
    mask = ChannelMask.from_dir(HUB[family])
    s = mask.stats(dtype=torch.bfloat16)
    assert "license: mit" in card and f"base_model: {mask.base_model}" in card
    assert "Not trained by leank" in card and "## Reported by the authors (not measured here)" in card
    assert f"{100 * s['k_kept_fraction']:.1f}%" in card and f"{s['zero_heads']} of {s['total_heads']}" in card
    assert f"{s['bytes_per_token']['leank']:,} vs {s['bytes_per_token']['dense']:,} dense" in card
    assert "LeanKModel.from_pretrained(\"hub/" in card and "![Kept channels per layer and head](pattern.png)" in card
    weights = mask.extra["base_model_parameters"] * 2
    assert capacity_table(mask, 80, weights) in card and "--capacity 80" in card
    assert "## Recipe" not in card


def test_statistics_against_the_paper():
    """The paper: about 70% of K and 16-18% of V removed. Llama's mask: 68.75% / 18.4%; Qwen's: 71.0% / 31.2%."""
    llama, qwen = (ChannelMask.from_dir(HUB[f]).stats() for f in ("llama", "qwen2"))
    assert (1 - llama["k_kept_fraction"], llama["zero_heads"], llama["total_heads"]) == (0.6875, 47, 256)
    assert 0.16 <= 1 - llama["v_kept_fraction"] <= 0.185
    assert abs(1 - qwen["k_kept_fraction"] - 0.7098) < 1e-4 and (qwen["zero_heads"], qwen["total_heads"]) == (35, 112)
    assert 1 - qwen["v_kept_fraction"] == 0.3125  # well above the paper's 16-18%: more whole heads dropped


def _save_reference(path: Path, obj) -> Path:
    torch.save(obj, path)
    (path.parent / "LICENSE").write_text("MIT License\n\nCopyright (c) Test\n")
    return path


class _Evil:
    """Unpickling this would run a shell command: the weights-only loader must refuse it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _bad_inputs(tmp: Path) -> dict[str, tuple[object, str]]:
    marker = tmp / "pwned"
    return {
        "code": (_Evil(str(marker)), "weights-only loader"),
        "dict": ({"mask": torch.ones(2, 2, 32)}, "holds a dict, not a single tensor"),
        "list": ([torch.ones(2, 2, 32)], "holds a list"),
        "2d": (torch.ones(4, 32), "expected a tensor [layers, kv_heads, head_dim]"),
        "values": (torch.full((2, 2, 32), 0.5), "only 0 and 1"),
        "empty": (torch.zeros(2, 2, 32), "keeps no channel"),
        "complex": (torch.ones(2, 2, 32, dtype=torch.complex64), "real-valued"),
    }


@pytest.mark.parametrize("case", ["code", "dict", "list", "2d", "values", "empty", "complex", "garbage", "missing"])
def test_import_refuses_anything_but_one_01_tensor(case, tmp_path, capsys):
    """One clear error, exit 2, nothing written, and no code runs (the `code` pickle would touch a file)."""
    src = tmp_path / "in" / "mask.pth"
    src.parent.mkdir()
    if case == "garbage":
        src.write_text("not a pickle")
        (src.parent / "LICENSE").write_text("MIT")
        message = "weights-only loader"
    elif case == "missing":
        message = "no such file"
    else:
        obj, message = _bad_inputs(tmp_path)[case]
        _save_reference(src, obj)
    out = tmp_path / "out" / "mask"
    assert cli(["import", str(src), str(out), "--base-model", "org/model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("leank import: error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert not (tmp_path / "pwned").exists()


def test_import_of_an_unknown_file(tmp_path, capsys):
    """A file leank does not know needs --base-model; ratio/align come from the mask; no size -> no capacity table."""
    keep = torch.zeros(3, 2, 64)
    keep[:, 0, :16] = 1
    keep[0, 1, :48] = 1
    src = _save_reference(tmp_path / "m.pth", keep)
    assert cli(["import", str(src), str(tmp_path / "a")]) == 2
    assert "--base-model" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert cli(["import", str(src), str(tmp_path / "a"), "--base-model", "org/model"]) == 0
    mask = ChannelMask.from_dir(tmp_path / "a")
    assert mask.align == 16 and mask.ratio == pytest.approx(1 - (3 * 16 + 48) / (3 * 2 * 64))
    assert mask.base_model == "org/model" and mask.extra["provenance"]["trained_by_leank"] is False
    assert mask.extra["provenance"]["notes"] == []  # an unknown release: no notes (not null)
    assert "base_model_parameters" not in mask.extra
    card = (tmp_path / "a" / "README.md").read_text()
    assert "Capacity" not in card and "Not trained by leank" in card
    assert (tmp_path / "a" / "LICENSE").read_text().startswith("MIT License")
    # an existing folder is kept unless --force
    before = (tmp_path / "a" / "config.json").read_text()
    assert cli(["import", str(src), str(tmp_path / "a"), "--base-model", "org/other"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "a" / "config.json").read_text() == before
    assert cli(["import", str(src), str(tmp_path / "a"), "--base-model", "org/other", "--force"]) == 0
    assert ChannelMask.from_dir(tmp_path / "a").base_model == "org/other"
    # a folder of the user's own files is never replaced, even with --force
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert cli(["import", str(src), str(tmp_path / "mine"), "--base-model", "org/other", "--force"]) == 2
    assert "not a mask repo" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    # the MIT notice must travel: no licence, no import
    (tmp_path / "LICENSE").unlink()
    assert cli(["import", str(src), str(tmp_path / "b"), "--base-model", "org/model"]) == 2
    assert "must travel with them (pass --license-file)" in capsys.readouterr().err and not (tmp_path / "b").exists()


def test_base_model_given_on_the_command_line_wins_over_a_known_release(tmp_path, monkeypatch, capsys):
    """Issue #31 item 7: a file leank knows (by sha256) defaults its base model, and --base-model overrides it."""
    from leank_infer.reference_import import sha256_of

    src = _save_reference(tmp_path / "m.pth", torch.ones(2, 2, 32))
    monkeypatch.setitem(KNOWN_RELEASES, sha256_of(src), {"base_model": "org/known", "path": "configs/m.pth"})
    assert cli(["import", str(src), str(tmp_path / "a")]) == 0
    assert ChannelMask.from_dir(tmp_path / "a").base_model == "org/known"
    assert cli(["import", str(src), str(tmp_path / "b"), "--base-model", "org/fine-tune"]) == 0
    mask = ChannelMask.from_dir(tmp_path / "b")
    assert mask.base_model == "org/fine-tune" and mask.extra["provenance"]["path"] == "configs/m.pth"


def test_import_records_its_provenance_licence_and_card(tmp_path, monkeypatch):
    """What `leank import` writes, field by field (the committed folders check it too, but only in slow tests):
    the provenance of a known release, its base-model size, the licence file given, the card's repo."""
    from leank_infer.reference_import import REFERENCE_COMMIT, REFERENCE_REPORTED, sha256_of

    src = _save_reference(tmp_path / "m.pth", torch.ones(2, 2, 32))
    digest = sha256_of(src)
    monkeypatch.setitem(KNOWN_RELEASES, digest, {"base_model": "org/known", "path": "configs/m.pth",
                                                 "base_model_parameters": 1234, "reported": ["r1"], "notes": ["n1"]})
    (tmp_path / "MY-LICENSE").write_text("MIT License\n\nmine\n")
    mask = import_reference_mask(src, tmp_path / "out", license_file=tmp_path / "MY-LICENSE")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["extra"] == {"provenance": {
        "source": "https://github.com/microsoft/MInference", "commit": REFERENCE_COMMIT, "path": "configs/m.pth",
        "sha256": digest, "license": "MIT", "copyright": "Copyright (c) Microsoft Corporation",
        "license_file": "LICENSE", "trained_by": "the LeanK authors (reference implementation)",
        "trained_by_leank": False, "converted_by": "leank import", "reported": [*REFERENCE_REPORTED, "r1"],
        "notes": ["n1"]}, "base_model_parameters": 1234}
    assert mask.extra == cfg["extra"] and (tmp_path / "out" / "LICENSE").read_text() == "MIT License\n\nmine\n"
    card = (tmp_path / "out" / "README.md").read_text()
    assert f'LeanKModel.from_pretrained("{tmp_path / "out"}")' in card and "Note: n1" in card
    with pytest.raises(MaskError, match="already exists"):  # replacing needs force=True
        import_reference_mask(src, tmp_path / "out")
    import_reference_mask(src, tmp_path / "out", repo="org/published", force=True)
    assert 'LeanKModel.from_pretrained("org/published")' in (tmp_path / "out" / "README.md").read_text()
    monkeypatch.delitem(KNOWN_RELEASES, digest)
    with pytest.raises(MaskError, match=rf"\(sha256 {digest[:12]}\.\.\.\): name its base model"):
        import_reference_mask(src, tmp_path / "other")


def test_import_aligns_to_the_head_dim_too(tmp_path):
    """Item 8: every head keeping 48 of 64 channels is a valid mask: align gcd(64, 48) = 16, not 48 (which
    does not divide head_dim and would refuse it)."""
    keep = torch.zeros(2, 2, 64)
    keep[..., :48] = 1
    src = _save_reference(tmp_path / "m.pth", keep)
    mask = import_reference_mask(src, tmp_path / "out", base_model="org/model")
    assert mask.align == 16 and ChannelMask.from_dir(tmp_path / "out").align == 16
    assert mask.ratio == pytest.approx(0.25)


def test_a_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    import leank_infer.hub.card as card

    src = _save_reference(tmp_path / "m.pth", torch.ones(2, 2, 32))

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(card, "write_card_files", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        import_reference_mask(src, tmp_path / "out", base_model="org/model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LICENSE", "m.pth"]
    # and a forced replacement that fails keeps the old folder
    monkeypatch.undo()
    import_reference_mask(src, tmp_path / "out", base_model="org/old")
    monkeypatch.setattr(card, "write_card_files", boom)
    with pytest.raises(RuntimeError):
        import_reference_mask(src, tmp_path / "out", base_model="org/new", force=True)
    assert ChannelMask.from_dir(tmp_path / "out").base_model == "org/old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LICENSE", "m.pth", "out"]


def test_the_import_is_the_only_pickle_reader():
    """No other module of leank calls torch.load / pickle.load, and the importer only ever weights-only."""
    readers = []
    for pkg in ("leank_infer", "leank_train"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            text = f.read_text()
            for needle in ("torch.load(", "pickle.load", "pickle.loads", "import pickle", "dill", "joblib"):
                if needle in text:
                    readers.append((f.name, needle))
    assert readers == [("reference_import.py", "torch.load(")]
    src = (ROOT / "leank_infer" / "reference_import.py").read_text()
    calls = src.split("torch.load(")[1:]
    assert calls and all("weights_only=True" in c.split(")")[0] for c in calls)
    # and the mask loader never opens anything but safetensors / JSON
    for folder in ("hub", "mask", "model"):
        for f in sorted((ROOT / "leank_infer" / folder).rglob("*.py")):
            assert "reference_import" not in f.read_text(), f


# ---- the capacity table ------------------------------------------------------------------------------


def test_capacity_rows_follow_the_formula():
    mask = ChannelMask.from_dir(HUB["llama"])
    per = mask.kv_bytes_per_token(torch.bfloat16)
    assert per == {"dense": 131072, "leank_middle": 73984}
    weights = mask.extra["base_model_parameters"] * 2
    rows = capacity_rows(mask, 80, weights)
    assert [r["context"] for r in rows] == [4096, 32768, 131072]
    free = 80 * GiB - weights
    for r in rows:
        full = 128 + 768 + 128
        leank = full * 131072 + (r["context"] - full) * 73984
        assert r["dense_gib"] == r["context"] * 131072 / GiB and r["leank_gib"] == leank / GiB
        assert r["dense_batch"] == int(free // (r["context"] * 131072)) and r["leank_batch"] == int(free // leank)
    assert rows[2]["dense_batch"] == 4 and rows[2]["leank_batch"] == 7  # 128k on 80 GiB
    assert sequence_kv_bytes(mask, 500) == {"dense": 500 * 131072, "leank": 500 * 131072}  # all inside the windows
    assert capacity_rows(mask, 10, weights)[0]["dense_batch"] == 0  # weights alone do not fit
    with pytest.raises(ValueError, match="positive"):
        capacity_rows(mask, 0, weights)


def test_weights_are_counted_at_the_dtypes_size():
    """Issue #31 item 9: fp32 weights take 4 bytes a parameter (at 2 they would halve and overstate the batch)."""
    from leank_infer.mask.capacity import weights_bytes_of

    mask = ChannelMask.from_dir(HUB["llama"])
    n = mask.extra["base_model_parameters"]
    sizes = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float8_e4m3fn: 1}
    assert {d: weights_bytes_of(mask, None, d) for d in sizes} == {d: n * b for d, b in sizes.items()}
    assert weights_bytes_of(mask, 70.0, torch.float32) == 70 * GiB  # given: taken as is
    rows = capacity_rows(mask, 80, weights_bytes_of(mask, None, torch.float32), torch.float32)
    free = 80 * GiB - 4 * n
    assert rows[0]["dense_batch"] == int(free // (4096 * 2 * 131072))  # fp32 K/V: twice bf16's bytes per token


def test_capacity_table_and_main_print_the_numbers_worked_out_by_hand(capsys):
    """The table's text against numbers worked out once (the fp32 Llama case of issue #31: 50/74 at 4k on 80 GiB),
    a GPU where nothing fits (0, no gain), and what --capacity prints above the table."""
    from leank_infer.mask.capacity import base_parameters, capacity_main, weights_bytes_of

    mask = ChannelMask.from_dir(HUB["llama"])
    n = mask.extra["base_model_parameters"]
    head = ["| context | dense KV GiB / seq | LeanK KV GiB / seq | dense max batch | LeanK max batch | batch gain |",
            "|---:|---:|---:|---:|---:|---:|"]
    assert capacity_table(mask, 80, 4 * n, torch.float32).splitlines() == head + [
        "| 4,096 | 1.000 | 0.673 | 50 | 74 | 1.48x |",
        "| 32,768 | 8.000 | 4.625 | 6 | 10 | 1.67x |",
        "| 131,072 | 32.000 | 18.171 | 1 | 2 | 2.00x |",
    ]
    assert capacity_table(mask, 16, 2 * n).splitlines()[2:] == [
        "| 4,096 | 0.500 | 0.337 | 2 | 3 | 1.50x |",
        "| 32,768 | 4.000 | 2.312 | 0 | 0 | - |",
        "| 131,072 | 16.000 | 9.086 | 0 | 0 | - |",
    ]
    assert capacity_rows(mask, 0.5, 0)[0]["dense_batch"] == 1  # half a GiB is a GPU size too
    assert capacity_main(str(HUB["llama"]), [80, 16], None, torch.float32, "leank bench x --capacity 80,16") == 0
    out = capsys.readouterr().out
    assert out.startswith("command: leank bench x --capacity 80,16\n")
    assert (f"mask: {HUB['llama']} (base model meta-llama/Llama-3.1-8B-Instruct), float32 K/V; weights 29.92 GiB"
            in out)
    assert "\nGPU memory 80 GiB:\n\n" + capacity_table(mask, 80, 4 * n, torch.float32) in out
    assert "\nGPU memory 16 GiB:\n\n" + capacity_table(mask, 16, 4 * n, torch.float32) in out
    assert weights_bytes_of(mask, 0.0, torch.float32) == 0  # weights given as 0 GiB: all memory is KV
    with pytest.raises(ValueError, match="--weights-gib must be >= 0, got -1"):
        weights_bytes_of(mask, -1.0, torch.float32)
    assert capacity_table(mask, 80, 4 * n, torch.float32, contexts=(1000,)).splitlines()[2:] == [
        "| 1,000 | 0.244 | 0.244 | 205 | 205 | 1.00x |"]  # the contexts asked for (all inside sink + recent)
    mask.extra["base_model_parameters"] = 1
    assert weights_bytes_of(mask, None, torch.float32) == 4
    mask.extra["base_model_parameters"] = 0  # recorded, but no size: as if not recorded
    assert base_parameters(mask) is None
    with pytest.raises(ValueError) as e:
        weights_bytes_of(mask, None, torch.float32)
    assert str(e.value).startswith("the mask does not record") and str(e.value).endswith("(GiB of weights)")


def test_bench_capacity_flag(capsys, tmp_path):
    assert cli(["bench", str(HUB["qwen2"]), "--capacity", "80,141"]) == 0
    out = capsys.readouterr().out
    mask = ChannelMask.from_dir(HUB["qwen2"])
    weights = mask.extra["base_model_parameters"] * 2
    assert capacity_table(mask, 80, weights) in out and capacity_table(mask, 141, weights) in out
    assert "assumption:" in out and "bfloat16" in out
    assert cli(["bench", str(HUB["qwen2"]), "--capacity", "80", "--weights-gib", "70"]) == 0
    assert capacity_table(mask, 80, 70 * GiB) in capsys.readouterr().out
    # a mask that does not record its base model's size: one clear error, exit 2
    ChannelMask.full(2, 2, 16, ratio=0.0, align=1).save_pretrained(tmp_path / "m")
    assert cli(["bench", str(tmp_path / "m"), "--capacity", "80"]) == 2
    assert "--weights-gib" in capsys.readouterr().err
    assert cli(["bench", str(HUB["qwen2"]), "--capacity", "lots"]) == 2


# ---- decoding at the real shapes -------------------------------------------------------------------


@torch.no_grad()
def padded_steps(lk: LeanKModel, rows: list[torch.Tensor], steps: int):
    """Greedy LeanK decoding of a left-padded batch by hand, as generate does it (positions from the
    attention mask): per row its tokens, the logits of every step, the recent sizes, and the cache
    regions and bytes right after the prefill."""
    b, t = len(rows), max(len(r) for r in rows)
    ids = torch.zeros(b, t, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, t - len(r) :], attn[i, t - len(r) :] = r, 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = lk.new_cache()
    logits = [lk(ids, attention_mask=attn, position_ids=pos, cache=cache).logits[:, -1]]
    regions, nbytes = cache.region_lengths(), lk.kv_cache_bytes(cache)
    layer = cache.layers[cache.leank_layers[0]]
    recents = []
    for _ in range(steps):
        nxt = logits[-1].argmax(-1, keepdim=True)
        ids, attn, pos = torch.cat([ids, nxt], 1), torch.cat([attn, torch.ones_like(nxt)], 1), pos[:, -1:] + 1
        logits.append(lk(nxt, attention_mask=attn, position_ids=pos, cache=cache).logits[:, -1])
        recents.append(ids.shape[1] - 1 - layer.recent_start)
    tokens = [torch.cat([r, ids[i, t:]]) for i, r in enumerate(rows)]
    return tokens, logits, recents, regions, nbytes


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed))


def check_against_rule(model, mask, rows, tokens, logits, recents, dtype):
    """Each row's LeanK logits at every step equal the LeanK rule over full K/V for that row alone: the query at
    position p of the row (counted from its first token) sees full keys from docs/rule.md's recent_from(p) on."""
    tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    for i, row in enumerate(rows):
        own = [p - documented_recent_from(p, mask.recent_size, mask.accumu_size)
               for p in range(len(row), len(row) + len(recents))]
        want = reference_steps(model, tokens[i][None], len(row), mask, own)
        for step, (got_b, want_b) in enumerate(zip(logits, want, strict=True)):
            torch.testing.assert_close(got_b[i : i + 1].float(), want_b.float(), msg=f"row {i} step {step}", **tol)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_real_decode_at_reference_sizes(family):
    """Real hidden size and attention, the mask's own sizes (sink 128, recent 768, accumu 128): a ~1k-token prompt
    decodes as the LeanK rule, and the cache holds the bytes ChannelMask.stats() says (fp32)."""
    model = shrunk_model(family, torch.float32)
    mask = sliced_mask(family)
    assert (mask.sink_size, mask.recent_size) == (128, 768) and (mask.kept_counts == 0).any()
    lk = LeanKModel(model, mask)
    rows = [prompt(1050, seed=1)]
    tokens, logits, recents, regions, nbytes = padded_steps(lk, rows, 3)
    # the next query's recent part starts 768 back, rounded down to a multiple of 128: 256
    assert regions == {"head": 128, "middle": 256 - 128, "tail": 1050 - 256, "total": 1050}
    per = mask.stats(dtype=torch.float32)["bytes_per_token"]
    assert nbytes == (128 + 794) * per["dense"] + 128 * per["leank"] == mask.kv_cache_bytes(1050, 1, torch.float32)
    check_against_rule(model, mask, rows, tokens, logits, recents, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_real_heads_padded_batch(family, dtype):
    """Real heads (32/28 query, 8/4 KV, 128 channels, real rope), imported kept channels, a left-padded batch
    of 2 through compressions: every step of every row equals the rule for that row alone; bytes per stats()."""
    model = shrunk_model(family, dtype, hidden=256)
    assert model_shape(model.config)[1:] == (REAL[family]["num_key_value_heads"], 128)
    mask = sliced_mask(family, **SMALL_SIZES)
    lk = LeanKModel(model, mask)
    rows = [prompt(110, seed=2), prompt(97, seed=3)]
    tokens, logits, recents, regions, nbytes = padded_steps(lk, rows, 20)
    assert regions["middle"] > 0 and len(set(recents)) > 1  # pruned middle, and compressions during decoding
    per = mask.stats(dtype=dtype)["bytes_per_token"]
    assert nbytes == 2 * ((regions["head"] + regions["tail"]) * per["dense"] + regions["middle"] * per["leank"])
    check_against_rule(model, mask, rows, tokens, logits, recents, dtype)
    with torch.no_grad():  # the mask really changes the result against dense decoding
        dense = model(tokens[0][None, :-1]).logits[:, -1]
    assert not torch.allclose(logits[-1][:1].float(), dense.float(), atol=1e-2)


# ---- training with the recipe's settings -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.filterwarnings(r"ignore:Found \d+ module\(s\) in eval mode")
def test_recipe_settings_train_on_real_heads(tmp_path):
    """The 8B recipe's settings (bf16 frozen model, activation checkpointing, ratio 0.7, align 32, lr/reg of
    each stage) for a few steps of stage 1 and stage 2 on the real Llama heads: only alpha learns, the
    checkpointed gradient equals the plain one, and the export keeps 0/32/64/96/128 channels per head."""
    import lightning as L

    from leank_train.data import NeedleDataModule, load_tokenizer
    from leank_train.distill.module import LeanKDistillation
    from leank_train.export import ExportMask
    from leank_train.pipeline import load_recipe
    from leank_train.recipe import stage_config

    llama = load_recipe(ROOT / "recipes" / "llama-3.1-8b.yaml")
    recipe = {f"stage{n}": stage_config(llama, n) for n in (1, 2)}
    recipe.update(recipe["stage1"])  # the shared settings (model, trainer) as stage 1 has them
    settings = {k: recipe["model"][k] for k in ("dtype", "ratio", "align", "activation_checkpointing", "min_lr_ratio")}
    assert settings == {"dtype": "bfloat16", "ratio": 0.7, "align": 32, "activation_checkpointing": True,
                        "min_lr_ratio": 0.1}  # fmt: skip
    dm = NeedleDataModule(min_length=120, max_length=200, length_intervals=2, num_samples=3, seed=0)
    dm.tokenizer = load_tokenizer("embedded")
    dm.setup()

    def module(stage: int, **kw):
        model = shrunk_model("llama", torch.bfloat16, hidden=256, vocab=len(dm.tokenizer))
        stage_cfg = recipe[f"stage{stage}"]["model"]
        kw = {"lr": stage_cfg["lr"], "reg_weight": stage_cfg["reg_weight"], **kw}
        settings_ = {k: v for k, v in settings.items() if k != "dtype"}
        return LeanKDistillation.for_model(model, stage=stage, sink_size=16, recent_size=64, warmup_steps=1,
                                           **settings_, **kw)  # fmt: skip

    def fit(m, steps: int, out: str):
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", precision=recipe["trainer"]["precision"],
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[ExportMask(dirpath=str(tmp_path / out))])  # fmt: skip
        trainer.fit(m, datamodule=dm)
        assert trainer.global_step == steps

    s1 = module(1)
    assert s1.llm.dtype == torch.bfloat16 and s1.llm.is_gradient_checkpointing
    # activation checkpointing changes memory, not gradients
    batch = next(iter(dm.train_dataloader()))
    with torch.no_grad():  # away from alpha = 1, where the student is the teacher and the distillation gradient is 0
        s1.alpha.copy_(torch.rand(s1.alpha.shape, generator=torch.Generator().manual_seed(0)) * 0.7 + 0.3)
    grads = []
    for ckpt in (True, False):
        s1.hparams.activation_checkpointing = ckpt
        s1.alpha.grad = None
        s1.losses(batch)[0].backward()  # the distillation term alone (L1's gradient does not involve the model)
        grads.append(s1.alpha.grad.clone())
    s1.hparams.activation_checkpointing = True
    s1.alpha.grad = None
    with torch.no_grad():
        s1.alpha.fill_(1.0)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1])
    frozen = {k: v.clone() for k, v in s1.llm.state_dict().items()}
    fit(s1, 2, "s1")
    assert (s1.alpha.detach() < 1).any() and all(torch.equal(v, frozen[k]) for k, v in s1.llm.state_dict().items())

    s2 = module(2, init_scores=str(tmp_path / "s1"))
    fit(s2, 2, "s2")
    final = ChannelMask.from_dir(tmp_path / "s2")
    assert final.keep.shape == (2, 8, 128) and final.ratio == 0.7 and final.align == 32
    assert set(final.kept_counts.unique().tolist()) <= {0, 32, 64, 96, 128}
    assert abs(float(final.keep.float().mean()) - 0.3) < 0.1


def test_known_releases_match_the_shared_readme():
    readme = SHARED / "README.md"
    if not readme.is_file():
        pytest.skip(f"{readme} is not on this machine")
    text = readme.read_text()
    for digest, release in KNOWN_RELEASES.items():
        assert digest in text and release["path"] in text and release["base_model"] in text
    assert json.loads((HUB["llama"] / "config.json").read_text())["extra"]["provenance"]["commit"] in text


def test_card_capacity_tables_are_the_commands_output():
    """Each committed card's capacity table (the docs show the cards) is what `leank bench MASK --capacity 80`
    prints for that mask now."""
    for family in ("llama", "qwen2"):
        mask = ChannelMask.from_dir(HUB[family])
        card = (HUB[family] / "README.md").read_text()
        assert f"`leank bench hub/{HUB[family].name} --capacity 80`" in card
        assert capacity_table(mask, 80, mask.extra["base_model_parameters"] * 2) in card
