"""The edges, round 3: the red team's probes of the newer surfaces, each one a row of a table test.

A compiled kernel is loaded only once verified; push reads only files with one link; leank removes only
leftovers it can prove are its own; a de-quantised copy without its record is rebuilt; pull names exact files
at one pinned commit; every peft field peft treats as a pattern is time-limited; an empty or misspelt vLLM
setting is one clear error; config overrides that change what the model computes need a stated reason.
The low cases are one table too: one clear line each, no traceback.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import subprocess
from pathlib import Path

import pytest
import test_hub
import torch
from conftest import assert_applies_as_peft_would
from test_hub import REPO, _hub_repo, hub_cache  # noqa: F401 - used below

from leank_infer.cli import main as leank
from leank_infer.decode.native_build import RECORD_SUFFIX, NativeLibrary, library_problem

pytestmark = pytest.mark.usefixtures("one_thread")
# test_hub's fixtures (the fake Hub, a mask repo folder), registered here under their own names
globals().update(hub=test_hub.hub, folder=test_hub.folder, card_folder=test_hub.card_folder)

OTHER_UID = 54321  # a user who is not us (the tests may run as root, who may chown)


# ---- 11 + 15: compiled kernels are loaded only once verified ---------------------------------------------------
PROBE_SOURCE = "extern \"C\" int leank_probe(void) { return 42; }\n"
PLANTED_SOURCE = "extern \"C\" int leank_probe(void) { return 7; }\n"  # same symbol, another answer


def _compile(source: str, out: Path) -> Path:
    src = out.with_suffix(".cpp")
    src.write_text(source)
    subprocess.run(["c++", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out


def _probe_library(tmp_path: Path, log: logging.Logger) -> NativeLibrary:
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE_SOURCE)

    def declare(lib: ctypes.CDLL) -> None:
        lib.leank_probe.restype = ctypes.c_int

    return NativeLibrary(source, "kernels", "LEANK_PROBE_KERNEL", "probe kernel", declare, log)


def _plant(case: str, lib: Path, elsewhere: Path) -> None:
    """Damage or replace the cached library ``lib`` the way a probe did."""
    record = lib.with_name(lib.name + RECORD_SUFFIX)
    if case == "another library":  # a different .so under the expected name, the record left as it was
        _compile(PLANTED_SOURCE, elsewhere / "planted.so").replace(lib)
    elif case == "another library with its own record, another user's":
        _compile(PLANTED_SOURCE, elsewhere / "planted.so").replace(lib)
        import hashlib

        record.write_text(hashlib.sha256(lib.read_bytes()).hexdigest())
        os.chown(lib, OTHER_UID, -1)
        os.chown(record, OTHER_UID, -1)
    elif case == "a symlink to a good build":
        good = elsewhere / "good.so"
        lib.replace(good)
        lib.symlink_to(good)
    elif case == "truncated":  # crashed every later run with a bus error
        data = lib.read_bytes()
        lib.write_bytes(data[: len(data) // 3])
    elif case == "another user's file":
        os.chown(lib, OTHER_UID, -1)
    elif case == "writable by others":
        os.chmod(lib, 0o777)
    elif case == "no record":  # an older leank's build, or one copied in by hand
        record.unlink()
    else:
        raise AssertionError(case)


@pytest.mark.parametrize("case", [
    "another library", "another library with its own record, another user's", "a symlink to a good build",
    "truncated", "another user's file", "writable by others", "no record",
])
def test_a_cached_kernel_is_loaded_only_once_verified(tmp_path, monkeypatch, caplog, case):
    """Item 11/15: whatever lies under the expected name is rebuilt unless it is this build's (one log line)."""
    if os.geteuid() != 0 and "user" in case:
        pytest.skip("chown to another user needs root")
    monkeypatch.setenv("LEANK_CACHE", str(tmp_path / "cache"))
    log = logging.getLogger("leank-test-probe")
    first = _probe_library(tmp_path, log).build()
    assert library_problem(first) is None
    (tmp_path / "elsewhere").mkdir()
    _plant(case, first, tmp_path / "elsewhere")
    assert library_problem(first) is not None
    probe = _probe_library(tmp_path, log)
    with caplog.at_level("WARNING", logger=log.name):
        assert probe.available()
    assert probe.lib.leank_probe() == 42  # the rebuilt library's answer, never the planted one's
    assert caplog.text.count("is not verified") == 1, caplog.text
    assert library_problem(first) is None and not first.is_symlink() and first.stat().st_uid == os.geteuid()


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_kernel_folder_other_users_may_write_to_is_refused(tmp_path, monkeypatch, caplog, mode):
    """Item 11: a shared, writable cache folder: nothing is built or loaded there; the PyTorch path is used."""
    monkeypatch.setenv("LEANK_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "kernels").mkdir(parents=True)
    os.chmod(tmp_path / "cache" / "kernels", mode)
    log = logging.getLogger("leank-test-probe")
    probe = _probe_library(tmp_path, log)
    with caplog.at_level("WARNING", logger=log.name):
        assert not probe.available()
        assert not probe.available()
    assert caplog.text.count("writable by other users") == 1, caplog.text
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_a_planted_kv_quant_kernel_never_changes_the_answer(tmp_path, monkeypatch):
    """Item 11 end to end: the real CPU kv_quant kernel's expected file replaced by one whose functions do
    nothing; the quantised decode still gives the PyTorch path's answer (the planted one is never loaded)."""
    from test_kv_quant import KD, _kernel_layer, _query, _rel_err

    from leank_infer.decode import quant_cpu
    from leank_infer.decode.layout import DecodeMasks
    from leank_infer.decode.torch_decode import torch_decode_attention

    real = quant_cpu.LIBRARY.build(directory=tmp_path / "first")  # where the expected name comes from
    cache = tmp_path / "cache" / "cpu-kernel"
    cache.mkdir(parents=True)
    _compile('extern "C" int leank_quant_k_scores(void *a) { return 0; }\n'
             'extern "C" int leank_quant_v_add(void *a) { return 0; }\n', cache / real.name)
    monkeypatch.setenv("LEANK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(quant_cpu.LIBRARY, "tried", False)
    monkeypatch.setattr(quant_cpu.LIBRARY, "lib", None)
    layer = _kernel_layer("int4-k32", steps=3)
    q = _query("int4-k32", layer)
    got = torch_decode_attention(q, layer.layout(), DecodeMasks(), KD**-0.5)
    assert quant_cpu.LIBRARY.lib is not None  # the kernel ran: rebuilt, verified, loaded
    ref = torch_decode_attention(q, layer.layout().dequantized(), DecodeMasks(), KD**-0.5)
    assert _rel_err(got, ref) < 2e-6
    assert library_problem(cache / real.name) is None


# ---- 12: push reads only files with one link ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["README.md", "eval.json", "LICENSE"])
def test_push_refuses_a_hard_linked_file(hub, folder, tmp_path, capsys, name):
    """Item 12: a credentials file hard-linked into a mask folder is not published (symlinks already were not)."""
    secret = tmp_path / "credentials"
    secret.write_bytes(b"aws_secret_access_key = AKIA")
    (folder / name).unlink(missing_ok=True)
    os.link(secret, folder / name)
    assert leank(["push", str(folder), REPO]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"leank push: error: {REPO}") and "2 hard links" in err and name in err, err
    assert err.count("\n") == 1 and REPO not in hub.repos  # nothing created, nothing uploaded
    (folder / name).unlink()
    (folder / name).write_bytes(secret.read_bytes())  # a copy of it is the user's choice to publish
    assert leank(["push", str(folder), REPO]) == 0


# ---- 13: leank removes only leftovers it can prove are its own -------------------------------------------------
def _small_mask(seed: int = 0):
    from leank_infer import ChannelMask

    return ChannelMask.from_scores(torch.rand(2, 2, 8, generator=torch.Generator().manual_seed(seed)), ratio=0.5,
                                   align=2)


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind", ["new", "old", "gone", "old-copied"])
@pytest.mark.parametrize("then", ["save", "open-missing"])
def test_a_users_folder_named_like_a_leftover_is_never_touched(tmp_path, kind, then):
    """Item 13: ``.m.{new,old,gone}-XXXXXXXX`` of the user's (or a leftover copied elsewhere and back: another
    inode) survives a save beside it, and opening a missing mask never moves the user's ``x`` into its place."""
    import shutil

    from leank_infer import ChannelMask
    from leank_infer.folders import atomic
    from leank_infer.mask import MaskError

    if kind == "old-copied":  # a real leftover's marker, copied: not this folder's
        (tmp_path / "elsewhere").mkdir()
        with atomic._fresh(tmp_path / "elsewhere", "m", "old") as p:
            pass
        users = shutil.copytree(p, tmp_path / p.name, symlinks=True)
    else:
        users = tmp_path / f".m.{kind}-abcd1234"
    (users / "x").mkdir(parents=True)
    _small_mask(3).save_pretrained(users / "x")  # even a loadable mask of the user's, in x
    (users / "x" / "notes.txt").write_text("mine")
    before = _tree(users)
    folder = tmp_path / "m"
    if then == "save":
        _small_mask().save_pretrained(folder)
        _small_mask(1).save_pretrained(folder)  # a replacement too
        assert ChannelMask.from_dir(folder).keep.equal(_small_mask(1).keep)
    else:
        with pytest.raises(MaskError, match="does not exist"):
            ChannelMask.from_dir(folder)
        assert not folder.exists()
    assert users.is_dir() and _tree(users) == before


# ---- 14: a de-quantised copy without its record is rebuilt, never trusted --------------------------------------
@pytest.mark.parametrize("case", ["no hash record", "no size record", "a file the record lacks",
                                  "a file added beside"])
def test_a_copy_without_its_record_is_rebuilt(fake_embedded, monkeypatch, case):
    """Item 14: a cached copy whose record is missing (an older leank's, ``cp dir/*``) or does not cover its
    files, with same-size damage to the weights, is rebuilt: the damage is never recorded as good."""
    import json

    import leank_infer.model.loading as loading

    copy = fake_embedded()
    weights = copy / "model.safetensors"
    good = weights.read_bytes()
    with open(weights, "r+b") as f:  # same size, other content
        f.seek(len(good) // 2)
        f.write(b"\xff" * 64)
    if case == "no hash record":
        (copy / loading.COPY_HASHES).unlink()
    elif case == "no size record":
        (copy / loading.COPY_MANIFEST).unlink()
    elif case == "a file the record lacks":  # the record rewritten without the damaged file
        hashes = json.loads((copy / loading.COPY_HASHES).read_text())
        del hashes["model.safetensors"]
        (copy / loading.COPY_HASHES).write_text(json.dumps(hashes))
    else:
        (copy / "model-00002-of-00002.safetensors").write_bytes(good)
        (copy / loading.COPY_HASHES).unlink()
    monkeypatch.setattr(loading, "_VERIFIED", {}, raising=False)  # a new process
    assert loading.copy_problem(copy) is not None
    with pytest.warns(UserWarning, match="damaged.*rebuilding"):
        assert fake_embedded() == copy
    assert weights.read_bytes() == good and loading.copy_problem(copy) is None
    assert sorted(p.name for p in copy.iterdir()) == sorted(
        [loading.COPY_HASHES, loading.COPY_MANIFEST, "config.json", "generation_config.json", "model.safetensors",
         "tokenizer.json"])


# ---- 16: pull names exact files at one pinned commit -----------------------------------------------------------
def _fetched(hub) -> list[str]:
    from urllib.parse import unquote

    return sorted({unquote(path.split("/resolve/", 1)[1].split("/", 1)[1]) for _, path in hub.requests
                   if "/resolve/" in path})


@pytest.mark.parametrize("odd", ["*.png", "[p]hoto.png", "?.png"])
def test_pull_downloads_listed_names_not_patterns(hub, odd):
    """Item 16: a 1-byte file named like a glob is fetched as itself, never as the photos its name matches."""
    from leank_infer import ChannelMask

    photos = {f"photos/{i}.png": b"p" * 2000 for i in range(40)} | {"photo.png": b"q" * 100, "x.png": b"x"}
    _hub_repo(hub, {odd: b"1", **photos})
    folder = ChannelMask.from_pretrained(REPO) and next(Path(hub_cache()).rglob("snapshots/*"))
    assert _fetched(hub) == sorted(["config.json", "mask.safetensors", odd, "photo.png", "x.png"])
    assert not (folder / "photos").exists() and (folder / odd).read_bytes() == b"1"


def test_pull_fetches_the_commit_it_listed(hub, monkeypatch):
    """Item 16: a push between the listing and the download changes nothing fetched: the download is of the
    commit the listing resolved (its sizes were checked), and main's ref points at that commit."""
    from huggingface_hub import HfApi

    from leank_infer import ChannelMask

    _hub_repo(hub, {})
    listed = hub.repos[REPO].branches["main"]
    big = {f"p{i:02d}.png": b"p" * 300_000 for i in range(20)}

    def push_right_after(listing):
        def listed_then_pushed(self, *args, **kwargs):
            info = listing(self, *args, **kwargs)
            info = info if not hasattr(info, "__next__") else list(info)
            if hub.repos[REPO].branches["main"] == listed:
                hub.commit(hub.repos[REPO], "main", big, [], "a push meanwhile")
            return info
        return listed_then_pushed

    for name in ("model_info", "list_repo_tree"):  # however the listing is asked for
        monkeypatch.setattr(HfApi, name, push_right_after(getattr(HfApi, name)))
    mask = ChannelMask.from_pretrained(REPO)
    assert _fetched(hub) == ["config.json", "mask.safetensors"]  # none of the pushed photos
    assert mask.keep.equal(ChannelMask.from_dir(next(Path(hub_cache()).rglob(f"snapshots/{listed}"))).keep)
    refs = next(Path(hub_cache()).rglob("refs/main"))
    assert refs.read_text() == listed


# ---- 18: an empty or misspelt vLLM LeanK setting is one clear error ---------------------------------------------
@pytest.mark.parametrize("config, message", [
    ({"leank_mask": ""}, re.escape("additional_config['leank_mask'] is '': give a mask folder")),
    ({"leank_mask": "  "}, re.escape("additional_config['leank_mask'] is '  ': give a mask folder")),
    ({"leank_mask": None}, re.escape("additional_config['leank_mask'] is None: give a mask folder")),
    ({"leank_mask": False}, re.escape("additional_config['leank_mask'] is False: give a mask folder")),
    ({"leank_mask": 0}, re.escape("additional_config['leank_mask'] is 0: give a mask folder")),
    ({"leank_mask": []}, r"additional_config\['leank_mask'\] is \[\]: give a mask folder"),
    ({"leank-mask": "hub/m"}, r"unknown LeanK setting\(s\) \['leank-mask'\]"),
    ({"LEANK_MASK": "hub/m"}, r"unknown LeanK setting\(s\) \['LEANK_MASK'\]"),
    ({"LeanK_Mask": "hub/m", "leank_mask": "hub/m"}, r"unknown LeanK setting\(s\) \['LeanK_Mask'\]"),
    ({"leank_rule": "positional"}, r"sets \['leank_rule'\] but no 'leank_mask'"),
    ({"leank_mask_revision": "v1", "leank_check_base_model": False}, r"sets \['leank_mask_revision', 'leank_check_base_model'\] but no 'leank_mask'"),
])
@pytest.mark.parametrize("env", [None, "hub/smollm2-135m-instruct"])
def test_an_empty_or_misspelt_vllm_setting_is_one_clear_error(monkeypatch, config, message, env):
    """Item 18: never a dense engine without a word; an explicit "" does not fall back to $LEANK_MASK."""
    from leank_infer.mask import MaskError
    from leank_infer.vllm.settings import settings_from

    if env is None:
        monkeypatch.delenv("LEANK_MASK", raising=False)
    else:
        monkeypatch.setenv("LEANK_MASK", env)
    if env is not None and "but no 'leank_mask'" in message:  # the variable names the mask: the settings apply
        assert settings_from(config).mask == env
        return
    with pytest.raises(MaskError, match=message) as err:
        settings_from(config)
    assert "\n" not in str(err.value)


def test_leank_is_off_only_without_any_leank_setting(monkeypatch):
    from leank_infer.vllm.settings import settings_from

    for value in (None, "", "  "):
        if value is None:
            monkeypatch.delenv("LEANK_MASK", raising=False)
        else:
            monkeypatch.setenv("LEANK_MASK", value)
        assert settings_from({}) is None and settings_from({"other_plugin": 1}) is None and settings_from(None) is None
    monkeypatch.setenv("LEANK_MASK", "env/mask")
    assert settings_from({"leank_mask": "cfg/mask"}).mask == "cfg/mask" and settings_from({}).mask == "env/mask"


# ---- 19: overrides that change what the model computes need the mask's reason ----------------------------------
def _override_repo(tmp_path: Path, overrides: dict, reason: str | None = None) -> Path:
    from test_hostile import write_config
    from test_model import tiny_repo

    mask_dir, _ = tiny_repo(tmp_path)
    extra = {"extra": {"config_overrides_reason": reason}} if reason is not None else {}
    return write_config(mask_dir, format_version=3, base_model=str(tmp_path / "base"), config_overrides=overrides,
                        **extra)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


@pytest.mark.parametrize("overrides, refused", [
    ({"hidden_act": "gelu"}, ["hidden_act"]),
    ({"rms_norm_eps": 0.5}, ["rms_norm_eps"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 3.0}}, ["rope_parameters"]),
    ({"rope_parameters": {**YARN, "rope_theta": 3.0}}, ["rope_parameters"]),
    ({"tie_word_embeddings": "FLIP"}, ["tie_word_embeddings"]),  # false loading a random head, or the reverse
    ({"pretraining_tp": 2, "max_position_embeddings": 4096}, ["pretraining_tp"]),
    ({"rope_parameters": {**YARN, "rope_theta": "SAME"}, "max_position_embeddings": 4096}, []),  # context: loads
    ({"rms_norm_eps": "SAME", "hidden_act": "SAME"}, []),  # the model's own values change nothing
])
@pytest.mark.parametrize("reason", [None, "", "learned on the fine-tune that sets it"])
def test_overrides_that_change_the_model_need_a_reason(tmp_path, overrides, refused, reason):
    """Item 19: every shape kept, the model still computes something else: refused unless the mask says why."""
    from transformers import AutoConfig

    from leank_infer import LeanKModel
    from leank_infer.mask import MaskError

    _override_repo(tmp_path / "probe", {})
    base = AutoConfig.from_pretrained(tmp_path / "probe" / "base")
    overrides = json_round(overrides, base)
    mask_dir = _override_repo(tmp_path, overrides, reason)
    if refused and not reason:
        with pytest.raises(MaskError, match=rf"config_overrides {re.escape(str(refused))} change what the base "
                                            r"model computes.*extra.config_overrides_reason"):
            LeanKModel.from_pretrained(mask_dir)
    else:
        config = LeanKModel.from_pretrained(mask_dir).model.config
        assert all(getattr(config, k) == v for k, v in overrides.items() if k != "rope_parameters")


def json_round(overrides: dict, base) -> dict:
    """Fill the placeholders with the base config's own values (SAME) or their opposite (FLIP)."""
    def fill(key, value):
        if isinstance(value, dict):
            return {k: fill(k, v) for k, v in value.items()}
        own = base.rope_parameters.get("rope_theta") if key == "rope_theta" else getattr(base, key, None)
        return own if value == "SAME" else (not own) if value == "FLIP" else value

    return {k: fill(k, v) for k, v in overrides.items()}


def test_generate_compares_with_the_unmodified_base_model(tmp_path, capsys):
    """Item 19: ``leank generate``'s dense column is the base model as published, not the mask's changed one."""
    from test_generate_cli import PROMPT
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mask_dir = _override_repo(tmp_path, {"rms_norm_eps": 50.0}, "a probe: the norm changed on purpose")
    base_dir = tmp_path / "base"
    tok = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    changed = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, rms_norm_eps=50.0).eval()
    enc = tok(PROMPT, return_tensors="pt")
    n = enc["input_ids"].shape[1]

    def answer(model) -> str:
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
        return tok.decode(out[0, n:], skip_special_tokens=True).strip()

    want, other = answer(base), answer(changed)
    assert want != other  # the probe really changes what the model says
    assert leank(["generate", str(mask_dir), "--prompt", PROMPT, "--max-new-tokens", "8", "--width", "400"]) == 0
    out = capsys.readouterr().out
    dense = out.splitlines()[-1].split(" | ")[0].strip()
    assert dense == want, out


# ---- 17: every peft field peft treats as a pattern is time-limited ---------------------------------------------
def _ia3_adapter(tmp_path: Path, **fields):
    import json

    from conftest import tiny_model
    from peft import IA3Config, get_peft_model

    base = tiny_model("llama")
    config = IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
    peft_model = get_peft_model(tiny_model("llama"), config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "ia3_l" in name:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    peft_model.save_pretrained(tmp_path / "ia3")
    cfg_path = tmp_path / "ia3" / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **fields}))
    return tmp_path / "ia3", base


@pytest.mark.parametrize("fields, message", [
    ({"feedforward_modules": r"(.|\w|[a-z.])*\d\d\d"}, r"feedforward_modules .* takes more than 2 s to match"),
    ({"feedforward_modules": "(unclosed"}, "feedforward_modules .* is not a valid regular expression"),
])
def test_an_ia3_adapters_feedforward_regex_is_bounded(tmp_path, alarm, fields, message):
    """Item 17: IA3's ``feedforward_modules`` (peft ``re.fullmatch``-es it) is matched with a time limit."""
    from leank_infer.model.loading import BaseModelError, apply_adapter

    folder, base = _ia3_adapter(tmp_path, **fields)
    alarm(30)
    with pytest.raises(BaseModelError, match=message):
        apply_adapter(base, folder)


def test_every_pattern_field_of_a_peft_config_is_checked():
    """Item 17: the ``*_pattern`` fields of other adapter types (their keys are matched by peft) are plain names too."""
    from peft import FourierFTConfig, LoHaConfig

    from leank_infer.model.adapter_patterns import AdapterPatternError, resolve_adapter_patterns

    for config in (LoHaConfig(target_modules=["q_proj"], alpha_pattern={"(a|a)*b": 2}),
                   FourierFTConfig(target_modules=["q_proj"], n_frequency_pattern={"(.*.*)*y": 10})):
        with pytest.raises(AdapterPatternError, match="_pattern .* must be plain module names"):
            resolve_adapter_patterns(config, ["model.q_proj"])


def test_an_ia3_adapter_with_a_plain_feedforward_regex_applies_as_peft_would(tmp_path, alarm):
    folder, base = _ia3_adapter(tmp_path, target_modules=r".*\.(k_proj|v_proj|down_proj)",
                                feedforward_modules=r".*\.down_proj")
    alarm(60)
    assert_applies_as_peft_would(folder, base)


# ---- 20: the low cases, one clear line each --------------------------------------------------------------------
@pytest.mark.parametrize("make, message", [
    (lambda: __import__("leank_infer.decode.kv_quant", fromlist=["KVQuant"]).KVQuant("int8", 8, k_group=2**26),
     "k_group must be a power of two from 1 to 1024, got 67108864"),
    (lambda: __import__("leank_infer.decode.kv_quant", fromlist=["KVQuant"]).KVQuant("int4", 8),
     "kv_quant name 'int4' does not match its 8 bits"),
    (lambda: __import__("leank_infer.decode.kv_quant", fromlist=["KVQuant"]).KVQuant("int8", True),
     "kv_quant bits must be 8 or 4, got True"),
    (lambda: __import__("leank_infer.decode.kv_quant", fromlist=["x"]).kv_quant_format(["int8"]),
     "kv_quant must be one of 'int8', 'int4' or None, got ['int8']"),
])
def test_a_bad_kv_quant_is_one_clear_error(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_bad_kv_quant_reaches_leank_model_as_one_clear_error(tmp_path):
    from test_model import tiny_repo

    from leank_infer import LeanKModel

    mask_dir, _ = tiny_repo(tmp_path)
    with pytest.raises(ValueError, match=r"kv_quant must be one of 'int8', 'int4' or None, got \['int8'\]"):
        LeanKModel.from_pretrained(mask_dir, kv_quant=["int8"])


def _read_only(monkeypatch) -> None:
    """What a user without write permission sees (the tests may run as root, whom permissions do not stop)."""
    import errno

    from leank_infer.folders import atomic

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(atomic.tempfile, "mkdtemp", refuse)


@pytest.mark.parametrize("how", ["leank import", "export", "save_pretrained"])
def test_a_read_only_target_is_one_clear_line(tmp_path, monkeypatch, capsys, how):
    from test_hostile import cli

    from leank_infer.mask import MaskError

    out = tmp_path / "ro" / "mask"
    out.parent.mkdir()
    _read_only(monkeypatch)
    if how == "leank import":
        torch.save(torch.ones(2, 2, 16), tmp_path / "m.pth")
        (tmp_path / "LICENSE").write_text("MIT License\n")
        code, err = cli(["import", str(tmp_path / "m.pth"), str(out), "--base-model", "org/m"], capsys)
        assert code == 2 and err.count("\n") == 1 and "Permission denied" in err and str(out) in err, err
    else:
        from leank_train.export import write_mask_repo

        write = (lambda: write_mask_repo(_small_mask(), out)) if how == "export" else (
            lambda: _small_mask().save_pretrained(out))
        with pytest.raises(MaskError, match=rf"cannot write {re.escape(str(out))}: Permission denied"):
            write()
    assert not list(out.parent.iterdir())


@pytest.mark.parametrize("target", ["~", "~/masks/m"])
def test_save_pretrained_to_tilde_is_refused(tmp_path, monkeypatch, target):
    from leank_infer.mask import MaskError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(MaskError, match="only a shell expands to a home folder.*give the full path"):
        _small_mask().save_pretrained(target)
    assert not list(tmp_path.iterdir())  # no folder named ~


def test_bench_threads_beyond_the_machine_is_one_line(tmp_path, capsys):
    from test_hostile import cli
    from test_model import tiny_repo

    mask_dir, _ = tiny_repo(tmp_path)
    code, err = cli(["bench", str(mask_dir), "--contexts", "64", "--batches", "1", "--new-tokens", "2",
                     "--threads", "100000"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--threads 100000: this machine has" in err, err


@pytest.mark.parametrize("size", [0, 3])
def test_an_empty_last_checkpoint_is_named_damaged(tmp_path, size):
    from leank_train.pipeline import checkpoint_damage

    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"PK\x03"[:size])
    assert checkpoint_damage(ckpt) == f"{size} bytes: a run killed as it began writing it"


@pytest.mark.parametrize("row, message", [
    ({"dataset": "needle-1k", "value": "high"}, "results row 0 has no finite number 'value'"),
    ({"dataset": "needle-1k", "value": 0.5, "metric_args": "x"}, "results row 0 has a 'metric_args' that is not an object"),
    ({"value": 0.5}, "results row 0 has no 'dataset' string"),
    ({"dataset": "needle-1k", "value": 0.5, "command": ["leank"]}, "results row 0 has a 'command' that is not a string"),
])
def test_eval_records_that_would_crash_the_card_are_refused_when_read(tmp_path, row, message):
    import json

    from leank_infer.hub.card import read_eval_record, write_model_card
    from leank_infer.mask import MaskError

    folder = _small_mask().save_pretrained(tmp_path / "m")
    (folder / "eval.json").write_text(json.dumps({"results": [row]}))
    for read in (lambda: read_eval_record(folder), lambda: write_model_card(folder)):
        with pytest.raises(MaskError, match=re.escape(message)) as err:
            read()
        assert "\n" not in str(err.value)


def test_backticks_in_a_recorded_command_stay_inside_its_code_span(tmp_path):
    import markdown

    from leank_infer.hub.card import write_model_card

    folder = _small_mask().save_pretrained(tmp_path / "m")
    command = "leank eval m `</code><img src=x onerror=alert(1)>` ``x``\n\n# Injected"
    write_model_card(folder, [{"dataset": "needle-1k", "value": 0.5, "command": command}])
    html = markdown.markdown((folder / "README.md").read_text())
    assert "<img src=x" not in html and "onerror=alert(1)&gt;" in html and "<h1>Injected" not in html


@pytest.mark.parametrize("where", ["a file", "full disk"])
def test_pull_into_a_cache_that_cannot_be_written_is_one_line(hub, tmp_path, monkeypatch, capsys, where):
    import errno

    from test_hostile import cli

    _hub_repo(hub, {})
    cache = tmp_path / "cache-file"
    cache.write_text("not a folder")
    if where == "full disk":
        cache = tmp_path / "cache"
        import huggingface_hub.file_download as fd

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(fd, "http_get", full)
    code, err = cli(["pull", REPO, "--cache-dir", str(cache)], capsys)
    message = f"cannot write the Hub cache {cache}: No space" if where == "full disk" else f"{cache} is a file"
    last = err.rstrip("\n").split("\n")[-1]  # (after huggingface_hub's download progress, on the full disk)
    assert code == 2 and last.startswith("leank pull: error:") and message in last and err.count("error") == 1, err


def test_leank_backend_triton_without_a_gpu_is_one_line(tmp_path, monkeypatch, capsys):
    from test_hostile import cli
    from test_model import tiny_repo

    from leank_infer.decode import triton_decode

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: triton runs")
    monkeypatch.setattr(triton_decode, "kernels_interpreted", lambda: False)  # as outside the tests
    mask_dir, _ = tiny_repo(tmp_path)
    monkeypatch.setenv("LEANK_BACKEND", "triton")
    code, err = cli(["generate", str(mask_dir), "--prompt", "w5 w6 w7", "--max-new-tokens", "2"], capsys)
    assert code == 2 and err.count("\n") == 1 and "LEANK_BACKEND=triton needs" in err, err


@pytest.mark.parametrize("command", [["run"], ["fit", "--config"]])
def test_a_file_that_is_no_recipe_is_never_echoed(tmp_path, capsys, command):
    from test_hostile import cli

    secret = tmp_path / "shadow"
    secret.write_text("root:$6$secrethash$xyz:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n")
    code, err = cli([*command, str(secret)], capsys)
    assert code == 2 and err.count("\n") == 1 and "line 1 holds no key name" in err, err
    assert "secrethash" not in err and "19000" not in err


def test_an_eval_record_too_big_for_a_card_is_refused_before_push(tmp_path):
    from leank_infer.hub.card import write_model_card
    from leank_infer.mask import MaskError

    folder = _small_mask().save_pretrained(tmp_path / "m")
    rows = [{"dataset": f"needle-{i}-" + "x" * 8000, "value": 0.5} for i in range(1100)]  # 8.8 MB of names
    with pytest.raises(MaskError, match=r"the card would be [\d,]+ bytes, over the 8,388,608 .* 1,100 result rows"):
        write_model_card(folder, rows)
    assert not (folder / "README.md").exists()  # the folder is as it was
