"""Edges the suite let through in the fit check, pulls, the copy hash, the recipe checks and the heap fix.

Each test here fails on one hand-made change of the code it names (docs/contributing.md, the mutant table of
"The edges of round 3") and passes on the code as it is: a boundary value or a property no other test pinned.
The quantised middle's two (kv_quant's outward rounding, the open K group) are in test_kv_quant.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_hub import REPO, _hub_repo, hub  # noqa: F401 - hub: the FakeHub fixture, used by name below

from leank_infer import ChannelMask
from leank_infer.mask import MaskError
from leank_infer.mask.fit import check_fit, config_differences
from leank_infer.mask.format import MAX_REPO_FILES

ROOT = Path(__file__).resolve().parent.parent


# ---- the fit check: any of the model's names may be the mask's base model ---------------------------------------
def _llama(name: str):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    cfg._name_or_path = name
    return cfg


def _mask(base: str) -> ChannelMask:
    keep = torch.ones(2, 2, 32, dtype=torch.bool)
    return ChannelMask(keep, sink_size=4, recent_size=8, accumu_size=4, base_model=base)


def test_a_model_served_under_another_name_fits_when_its_config_names_the_base_model():
    """vLLM passes the served name and the config's name: one of them being the mask's base model is enough."""
    cfg = _llama("org/base")
    check_fit(_mask("org/base"), cfg, ["my-served-alias", cfg._name_or_path])
    check_fit(_mask("org/base"), cfg, [cfg._name_or_path, "my-served-alias"])
    check_fit(_mask("org/base"), cfg, [None, "", "org/BASE"])  # empty names are skipped, ids compare caselessly
    with pytest.raises(MaskError, match="trained for 'org/base' but the model is 'my-served-alias'"):
        check_fit(_mask("org/base"), cfg, ["my-served-alias", "org/other"])


def test_names_that_cannot_be_compared_are_not(tmp_path):
    """A local folder (as the model's name or the mask's base model) and a mask without a base model are never
    compared: they fit any name."""
    from leank_infer.mask.fit import same_model_id

    folder = str(tmp_path)
    cfg = _llama(folder)
    check_fit(_mask("org/base"), cfg, [folder])
    check_fit(_mask(folder), _llama("org/x"), ["org/x"])
    check_fit(_mask(None), cfg, ["org/x"])
    assert same_model_id(folder, "org/x") and same_model_id("org/x", folder) and same_model_id(None, "org/x")
    assert same_model_id("org/x", None) and same_model_id("", "org/x")
    assert same_model_id("/Org/X/", "org/x") and same_model_id("org/x", "/Org/X/") and not same_model_id("org/x", "org/y")


def test_every_problem_is_named_in_one_error_or_warning_pointing_at_the_callers_caller():
    """Name, adapter and overrides in one message joined by "; ", with the opt-out; as a warning when the check is
    off, attributed to the caller of the function that called check_fit (a user's line, not leank's)."""
    import re

    cfg = _llama("org/base")
    cfg.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    carried = ChannelMask(torch.ones(2, 2, 32, dtype=torch.bool), sink_size=4, recent_size=8, accumu_size=4,
                          base_model="org/base", config_overrides={"rope_parameters": {"factor": 4.0}})
    check_fit(carried, cfg, ["org/base"])  # the model carries what the mask was learned with
    mask = ChannelMask(torch.ones(2, 2, 32, dtype=torch.bool), sink_size=4, recent_size=8, accumu_size=4,
                       base_model="org/other", adapter="org/lora", config_overrides={"hidden_act": "gelu", "x": 1})
    message = ("the mask was trained for 'org/other' but the model is 'org/base'; the mask was learned on "
               "'org/other' with the PEFT adapter 'org/lora' merged (use the merged fine-tune); the mask was learned "
               "with config overrides the model lacks (hidden_act: model has 'silu', mask wants 'gelu'; x: model has "
               "None, mask wants 1)")
    with pytest.raises(MaskError) as err:
        check_fit(mask, cfg, ["org/base"])
    assert str(err.value) == message + " (pass check_base_model=False to use it anyway)"
    with pytest.raises(MaskError, match=re.escape(message + " (set X to use it anyway)")):
        check_fit(mask, cfg, ["org/base"], opt_out="set X")

    def load() -> None:  # what a caller of check_fit looks like (load_checked_mask, LeanKModel)
        check_fit(mask, cfg, ["org/base"], check_base_model=False)

    with pytest.warns(UserWarning) as record:
        line = sys._getframe().f_lineno + 1  # the warning points at the next line
        load()
    assert str(record[0].message) == message + "; shapes fit, so it is used as requested"
    where = (record[0].filename, record[0].lineno)
    assert where == (__file__, line) or "mutmut" in where[0], where  # (mutmut's trampoline adds frames of its own)


# ---- a dict-valued override: carried when each wanted key has the wanted value ------------------------------------
def test_a_dict_override_the_model_extends_with_keys_of_its_own_is_carried():
    """transformers adds defaults of its own to ``rope_parameters``: the mask's keys having its values is enough;
    a different value, a missing key or a missing attribute is a difference named with both values."""
    want = {"rope_type": "yarn", "factor": 4.0, "extra": {"beta_fast": 32}}
    extended = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 8192,
                "extra": {"beta_fast": 32, "beta_slow": 1}}
    assert config_differences(SimpleNamespace(rope_parameters=extended), {"rope_parameters": want}) == []
    assert config_differences(SimpleNamespace(rope_parameters=dict(want)), {"rope_parameters": want}) == []
    for have in ({**extended, "factor": 8.0}, {k: v for k, v in extended.items() if k != "factor"},
                 {**extended, "extra": {"beta_fast": 16}}, None, "yarn"):
        cfg = SimpleNamespace(rope_parameters=have) if have is not None else SimpleNamespace()
        (line,) = config_differences(cfg, {"rope_parameters": want})
        assert line == f"rope_parameters: model has {have!r}, mask wants {want!r}"
    assert config_differences(SimpleNamespace(hidden_act="gelu"), {"hidden_act": "silu"}) == [
        "hidden_act: model has 'gelu', mask wants 'silu'"
    ]


# ---- a pull: a repo of exactly the maximum file count is a mask repo, one more is not --------------------------------
@pytest.mark.parametrize("extra_files, refused", [(MAX_REPO_FILES - 2, False), (MAX_REPO_FILES - 1, True)],
                         ids=["at-the-maximum", "one-over"])
def test_a_pull_takes_a_repo_of_exactly_the_maximum_file_count(hub, extra_files, refused):  # noqa: F811
    """Config and mask plus ``extra_files`` plots: ``MAX_REPO_FILES`` files in all pull, one more is refused
    before anything is downloaded."""
    _hub_repo(hub, {f"plot{i:02d}.png": b"png%d" % i for i in range(extra_files)})
    total = extra_files + 2
    if refused:
        with pytest.raises(MaskError, match=f"holds {total} mask repo files; a mask repo has at most {MAX_REPO_FILES}"):
            ChannelMask.from_pretrained(REPO)
        assert not [path for _, path in hub.requests if "/resolve/" in path]
    else:
        assert ChannelMask.from_pretrained(REPO).num_layers == 3
        fetched = {path.rsplit("/", 1)[-1] for _, path in hub.requests if "/resolve/" in path}
        assert len(fetched) == total == MAX_REPO_FILES


# ---- the de-quantised copy's hash reads the whole file -------------------------------------------------------------
def test_the_copy_hash_covers_every_byte_of_a_file_past_its_first_blocks(tmp_path):
    """A one-byte change 5 MiB into a 6 MiB file (past the first 4 MiB read block) changes the recorded hash."""
    from leank_infer.model.loading import _sha256

    data = bytearray(os.urandom(1 << 16)) * 96  # 6 MiB
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    whole = _sha256(path)
    assert whole == hashlib.sha256(data).hexdigest()
    data[5 << 20] ^= 1
    path.write_bytes(data)
    assert _sha256(path) == hashlib.sha256(data).hexdigest() != whole
    data[5 << 20] ^= 1
    data[-1] ^= 0x80  # the very last byte too
    path.write_bytes(data)
    assert _sha256(path) != whole


# ---- the recipe check: max_length may equal min_length --------------------------------------------------------------
def test_a_recipe_of_one_length_passes_and_a_shorter_max_is_named():
    from leank_train.pipeline import load_recipe
    from leank_train.recipe_checks import recipe_problems

    recipe = load_recipe(ROOT / "recipes" / "smollm2-135m.yaml")
    assert recipe_problems(dataclasses.replace(recipe, min_length=1024, max_length=1024)) == []
    assert recipe_problems(dataclasses.replace(recipe, min_length=1024, max_length=1023)) == [
        "--max_length: must be at least --min_length (1024), got 1023"
    ]


# ---- the heap fix sets glibc's mmap threshold (not another parameter) ------------------------------------------------
HEAP_SCRIPT = textwrap.dedent("""
    import ctypes, sys
    from leank_train.heap import THRESHOLD, fix_mmap_threshold

    libc = ctypes.CDLL("libc.so.6")
    class Info(ctypes.Structure):  # glibc's struct mallinfo2
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def mmapped(size):  # whether malloc serves a block of `size` bytes with a mapping of its own
        before = libc.mallinfo2().hblks
        p = libc.malloc(size)
        grew = libc.mallinfo2().hblks - before
        libc.free(p)
        return bool(grew)

    fixed = fix_mmap_threshold() if sys.argv[1:] == ["fix"] else None
    print(fixed, mmapped(1 << 20), mmapped(THRESHOLD // 2), mmapped(2 * THRESHOLD))
""")


@pytest.mark.skipif(not (sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")),
                    reason="glibc's allocator only")
def test_the_heap_fix_serves_a_1_mib_block_from_the_heap_and_a_larger_one_mapped():
    """In a fresh process, 1 MiB is mapped at glibc's start (threshold 128 KiB); after fix_mmap_threshold 1 MiB
    and 2 MiB come from the heap and 8 MiB is mapped: the threshold is 4 MiB."""
    import leank_train

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = str(Path(leank_train.__file__).resolve().parents[1])  # the leank this test imports
    outs = {}
    for fix in ("", "fix"):
        out = subprocess.run([sys.executable, "-c", HEAP_SCRIPT, fix], capture_output=True, text=True, env=env,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        outs[fix] = out.stdout.split()
    assert outs == {"": ["None", "True", "True", "True"], "fix": ["True", "False", "False", "True"]}, outs
