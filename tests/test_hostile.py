"""Issue #21, hostile input: a mask from a stranger runs no code, deletes no file, leaves nothing half-written.

Each test plays the attack or the bad input and asserts one clear error (CLI: exit code 2, one line,
no traceback) and that nothing was written, deleted or executed.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from test_model import random_mask, tiny_repo

from leank_infer import ChannelMask, LeanKModel
from leank_infer.cli import main as leank
from leank_infer.mask import CONFIG_FILE, MASK_FILE, MaskError
from leank_infer.model.loading import BaseModelError, copy_problem, resolve_base_model

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent


def cli(args: list[str], capsys) -> tuple[int, str]:
    """Run ``leank ARGS``; (exit code, stderr). argparse's usage errors exit through SystemExit(2)."""
    capsys.readouterr()
    try:
        code = leank(args)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def tree(folder: Path) -> dict[str, bytes | str]:
    """Everything under ``folder``: file bytes, link targets, folder markers (to assert nothing changed)."""
    out: dict[str, bytes | str] = {}
    for p in sorted(folder.rglob("*")):
        key = str(p.relative_to(folder))
        out[key] = f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


def write_config(folder: Path, **changes) -> Path:
    """A valid mask folder whose config.json then gets ``changes`` (None deletes a key), written by hand."""
    random_mask().save_pretrained(folder)
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / CONFIG_FILE).write_text(json.dumps(cfg))
    return folder


# ---- 1. a mask cannot run code --------------------------------------------------------------------------
def evil_base(folder: Path, marker: Path) -> Path:
    """A base-model folder whose custom (auto_map) config/model class writes ``marker`` when imported."""
    folder.mkdir(parents=True)
    code = (
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('code ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    )
    (folder / "evil.py").write_text(code)
    config = {
        "model_type": "evil", "architectures": ["EvilModel"],
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 256,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


LOADER_OPTIONS = {
    "trust_remote_code": True, "revision": "main", "token": "hf_x", "cache_dir": "/tmp/x", "device_map": "auto",
    "quantization_config": {"load_in_4bit": True}, "code_revision": "main", "subfolder": "..",
    "gguf_file": "x.gguf", "attn_implementation": "eager", "auto_map": {}, "_attn_implementation": "eager",
}


@pytest.mark.parametrize("option", sorted(LOADER_OPTIONS))
def test_config_overrides_cannot_set_loader_options(tmp_path, option):
    marker = tmp_path / "pwned"
    base = evil_base(tmp_path / "evil-base", marker)
    mask_dir = write_config(tmp_path / "mask", format_version=3, base_model=str(base),
                            config_overrides={option: LOADER_OPTIONS[option]})
    with pytest.raises(MaskError, match=rf"config_overrides.*{option}"):
        LeanKModel.from_pretrained(mask_dir)
    assert not marker.exists()


def test_a_base_model_with_custom_code_is_refused_not_run(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    base = evil_base(tmp_path / "evil-base", marker)
    mask_dir = write_config(tmp_path / "mask", base_model=str(base))
    with pytest.raises(BaseModelError, match="evil"):
        LeanKModel.from_pretrained(mask_dir)  # no prompt either: trust_remote_code is False, not unset
    assert not marker.exists()
    # the control: the caller (not the mask) may opt in, and then the code does run, so the test can see it
    import transformers.dynamic_module_utils as dyn

    monkeypatch.setattr(dyn, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(Exception):  # noqa: B017 (the evil model has no tokenizer: whatever comes after, code ran)
        LeanKModel.from_pretrained(mask_dir, trust_remote_code=True)
    assert marker.read_text() == "code ran"


def test_config_overrides_must_be_attributes_of_the_base_config(tmp_path, monkeypatch):
    mask_dir, _ = tiny_repo(tmp_path)
    write_config(mask_dir, format_version=3, base_model=str(tmp_path / "base"),
                 config_overrides={"not_a_config_field": 1})
    import transformers

    def never(*a, **k):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    with pytest.raises(MaskError, match=r"\['not_a_config_field'\] are not attributes of LlamaConfig"):
        LeanKModel.from_pretrained(mask_dir)


def test_config_overrides_that_are_config_attributes_still_load(tmp_path):
    mask_dir, _ = tiny_repo(tmp_path)
    write_config(mask_dir, format_version=3, base_model=str(tmp_path / "base"), config_overrides={"rms_norm_eps": 1e-3},
                 extra={"config_overrides_reason": "learned on the fine-tune that uses it"})
    assert LeanKModel.from_pretrained(mask_dir).model.config.rms_norm_eps == 1e-3


# ---- 2. exporting replaces only a mask repo, as a whole ------------------------------------------------------
@pytest.mark.parametrize("how", ["save_pretrained", "write_mask_repo"])
@pytest.mark.parametrize("target", ["user-folder", "file", "symlink", "root"])
def test_export_refuses_what_is_not_a_mask_repo(tmp_path, how, target):
    from leank_train.export import write_mask_repo

    user = tmp_path / "work"
    (user / "notes").mkdir(parents=True)
    (user / "thesis.tex").write_text("years of work")
    (user / "notes" / "a.txt").write_text("a")
    (tmp_path / "file.txt").write_text("keep me")
    (tmp_path / "link").symlink_to(user)
    path = {"user-folder": user, "file": tmp_path / "file.txt", "symlink": tmp_path / "link", "root": Path("/")}
    before, root_before = tree(tmp_path), sorted(os.listdir("/"))
    write = (lambda p: random_mask().save_pretrained(p)) if how == "save_pretrained" else (
        lambda p: write_mask_repo(random_mask(), p))
    with pytest.raises(MaskError, match="not a mask repo|not a folder|symlink|not a folder name"):
        write(path[target])
    assert tree(tmp_path) == before and sorted(os.listdir("/")) == root_before


def test_export_replaces_an_older_mask_repo_or_an_empty_folder(tmp_path):
    from leank_train.export import write_mask_repo

    repo = write_mask_repo(random_mask(seed=1), tmp_path / "repo")
    assert {p.name for p in repo.iterdir()} >= {MASK_FILE, CONFIG_FILE, "README.md"}
    write_mask_repo(random_mask(seed=2), repo)
    assert torch.equal(ChannelMask.from_dir(repo).keep, random_mask(seed=2).keep)
    (tmp_path / "empty").mkdir()
    random_mask().save_pretrained(tmp_path / "empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "repo"]  # no temporary sibling left


def test_without_an_atomic_exchange_the_swap_still_replaces_whole(tmp_path, monkeypatch):
    import leank_infer.folders.atomic as swap

    monkeypatch.setattr(swap, "_exchange", lambda a, b: False)  # a file system without renameat2's exchange
    random_mask(seed=1).save_pretrained(tmp_path / "m")
    random_mask(seed=2).save_pretrained(tmp_path / "m")
    assert torch.equal(ChannelMask.from_dir(tmp_path / "m").keep, random_mask(seed=2).keep)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(MaskError, match="cannot make the folder"):
        random_mask().save_pretrained(tmp_path / "file" / "m")


def test_fit_refuses_a_user_folder_as_export_before_training(tmp_path, capsys):
    from test_faults import base_model, recipe

    base = base_model(tmp_path / "base")
    (tmp_path / "r" / "mine").mkdir(parents=True)
    (tmp_path / "r" / "mine" / "data.csv").write_text("1,2,3")
    path = recipe(tmp_path / "r", base, {"stage1_dir": str(tmp_path / "r" / "mine")})
    code, err = cli(["run", str(path), "--stage", "1"], capsys)
    assert code == 2 and "is a folder that is not a mask repo" in err
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["mine", "recipe.yaml"]
    assert (tmp_path / "r" / "mine" / "data.csv").read_text() == "1,2,3"


# ---- 3. concurrent saves never mix two masks; readers see one or the other ---------------------------------
WRITER = """
import sys, time, torch
from leank_infer import ChannelMask
k, folder = int(sys.argv[1]), sys.argv[2]
scores = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(k))
mask = ChannelMask.from_scores(scores, 0.5, 4, sink_size=k, recent_size=11 * k)
print("ready", flush=True)
until = float(sys.stdin.readline())  # all start together, once imported
n = 0
while time.time() < until:
    mask.save_pretrained(folder)
    n += 1
print(n)
"""


def test_concurrent_saves_never_mix_and_readers_never_see_half(tmp_path):
    folder = tmp_path / "mask"
    expected = {
        k: ChannelMask.from_scores(torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(k)), 0.5, 4).keep
        for k in (1, 2)
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(k), str(folder)], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k in (1, 2)
    ]
    for w in writers:
        assert w.stdout.readline().strip() == "ready", w.stderr.read()
    until = time.time() + 4
    for w in writers:
        w.stdin.write(f"{until}\n")
        w.stdin.flush()
    reads, problems = 0, []
    while time.time() < until:
        if not folder.exists():
            time.sleep(0.01)
            continue
        try:
            m = ChannelMask.from_dir(folder)
        except MaskError as e:
            problems.append(str(e))
            continue
        reads += 1
        k = m.sink_size
        if m.recent_size != 11 * k or not torch.equal(m.keep, expected[k]):
            problems.append(f"mixed: sink {k}, recent {m.recent_size}")
    counts = []
    for w in writers:
        out, err = w.communicate(timeout=60)
        assert w.returncode == 0, err
        counts.append(int(out))
    assert min(counts) > 5 and reads > 5, (counts, reads)  # both wrote and we read, many times
    assert problems == [], (len(problems), problems[:3])
    print("writes", counts, "reads", reads)
    final = ChannelMask.from_dir(folder)
    assert torch.equal(final.keep, expected[final.sink_size])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mask"]  # no temporary folders left behind


# ---- 4. revisions and repo ids cannot leave the Hub cache ------------------------------------------------------
def fake_cache(tmp_path: Path) -> tuple[Path, Path]:
    """An HF cache with one pulled mask repo, and a mask folder outside it that a revision could walk to."""
    cache = tmp_path / "cache"
    repo = cache / "models--org--name"
    commit = "a" * 40
    random_mask(seed=1).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    outside = random_mask(seed=2).save_pretrained(tmp_path / "outside")
    (tmp_path / "ref.txt").write_text("../../../outside")  # any file can be read as a ref
    return cache, outside


@pytest.mark.parametrize("revision", ["../../../ref.txt", "../../../outside", "..", "/etc", "main/../../x", "a b", ".hidden"])
def test_revisions_cannot_escape_the_hub_cache(tmp_path, monkeypatch, capsys, revision):
    cache, _ = fake_cache(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MaskError, match="revision"):
        ChannelMask.from_pretrained("org/name", revision=revision, cache_dir=cache)
    code, err = cli(["pull", "org/name", "--revision", revision, "--cache-dir", str(cache)], capsys)
    assert code == 2 and err.startswith("leank pull: error:") and err.count("\n") == 1


def test_the_revision_escape_is_real_without_the_check(tmp_path, monkeypatch):
    """The control: huggingface_hub itself reads a file outside the cache as the ref, and the folder it
    names as the snapshot."""
    from huggingface_hub import snapshot_download

    cache, outside = fake_cache(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = snapshot_download("org/name", revision="../../../ref.txt", cache_dir=cache, local_files_only=True)
    assert Path(got).resolve() == outside.resolve()
    main = ChannelMask.from_pretrained("org/name", revision="main", cache_dir=cache)  # a real revision still works
    assert torch.equal(main.keep, random_mask(seed=1).keep)


@pytest.mark.parametrize("field", ["base_revision", "adapter_revision"])
def test_a_mask_cannot_name_an_escaping_revision(tmp_path, field):
    extra = {"adapter": "org/adapter"} if field == "adapter_revision" else {}
    folder = write_config(tmp_path / "m", **extra, **{field: "../../../../etc"}, format_version=2 if extra else 1)
    with pytest.raises(MaskError, match=f"{field}: revision '../../../../etc' contains '..'"):
        ChannelMask.from_dir(folder)


@pytest.mark.parametrize("name", ["", "   ", "x" * 500, "a/" * 300, "../../x"])
def test_bad_repo_ids_are_one_clear_error(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MaskError) as e:
        ChannelMask.from_pretrained(name)
    assert len(str(e.value)) < 700
    assert list(tmp_path.iterdir()) == []


def test_the_current_folder_is_named_not_silently_used(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("./", "."):
        with pytest.raises(MaskError, match=f"missing in .* \\(that is {tmp_path}\\)"):
            ChannelMask.from_pretrained(name)


# ---- 5. length bounds in every entry point --------------------------------------------------------------------
@pytest.fixture
def short_repo(tmp_path) -> Path:
    """A tiny mask repo whose base model has only 64 positions."""
    mask_dir, _ = tiny_repo(tmp_path)
    cfg_path = tmp_path / "base" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "max_position_embeddings": 64}))
    return mask_dir


def test_generate_refuses_a_prompt_beyond_the_models_positions(short_repo, capsys):
    prompt = " ".join(["w5"] * 70)
    code, err = cli(["generate", str(short_repo), "--prompt", prompt, "--max-new-tokens", "4"], capsys)
    assert code == 2 and "the prompt is 70 tokens" in err and "64 positions" in err
    code, err = cli(["generate", str(short_repo), "--prompt", " ".join(["w5"] * 61), "--max-new-tokens", "4"], capsys)
    assert code == 2 and "64 positions" in err  # 61 + 4 > 64
    assert cli(["generate", str(short_repo), "--prompt", " ".join(["w5"] * 60), "--max-new-tokens", "4"],
               capsys)[0] == 0


def test_bench_refuses_contexts_beyond_the_models_positions(short_repo, capsys):
    code, err = cli(["bench", str(short_repo), "--contexts", "100", "--batches", "1", "--new-tokens", "4"], capsys)
    assert code == 2 and "--contexts 100 + 4 new tokens exceeds the model's 64 positions" in err


def test_eval_refuses_lengths_beyond_the_models_positions(short_repo, capsys):
    # the suite: a length is the whole budget (prompt + generation, as in RULER)
    code, err = cli(["eval", str(short_repo), "--lengths", "100000", "--samples", "1"], capsys)
    assert code == 2 and "--lengths 100,000 exceeds the model's 64 positions" in err
    # the needle kinds: a length is the prompt's, the answer comes on top
    code, err = cli(["eval", str(short_repo), "--kinds", "passkey", "--lengths", "100000", "--samples", "1"], capsys)
    assert code == 2 and "--lengths 100,000 + 24 new tokens exceeds the model's 64 positions" in err


# ---- Also: config.json and file-kind abuse ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, message",
    [
        ("[" * 100_000 + "]" * 100_000, "nests JSON too deeply"),
        ('{"format_version": 1, "x": ' + "[" * 40 + "]" * 40 + "}", "nests JSON too deeply"),
        ('{"format_version": ' + "9" * 5000 + "}", "not valid JSON"),
        ('{"format_version": 1', "not valid JSON"),
        ("\xff\xfe", "not UTF-8"),
    ],
    ids=["deep-list", "deep-field", "huge-int", "truncated", "binary"],
)
def test_malformed_config_json_is_one_mask_error(tmp_path, text, message):
    random_mask().save_pretrained(tmp_path / "m")
    (tmp_path / "m" / CONFIG_FILE).write_bytes(text.encode("latin-1") if text == "\xff\xfe" else text.encode())
    with pytest.raises(MaskError, match=message):
        ChannelMask.from_dir(tmp_path / "m")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"sink_size": 10**30}, r"sink_size must be an integer in \[0, 2147483647\]"),
        ({"recent_size": 1e30}, "recent_size must be an integer"),
        ({"head_dim": 0}, "head_dim must be a positive integer"),
        ({"num_layers": True}, "num_layers must be a positive integer"),
        ({"format_version": True}, "unknown format_version True"),
        ({"format_version": 1.0}, "unknown format_version 1.0"),
        ({"extra": [1, 2]}, "extra must be a JSON object"),
        ({"extra": "x"}, "extra must be a JSON object"),
        ({"loader": ["x"]}, "loader must be a JSON object"),
        ({"loader": {"gguf_file": "../../../../etc/passwd"}}, "loader.gguf_file: .* without '..'"),
        ({"loader": {"gguf_file": "/etc/passwd"}}, "loader.gguf_file"),
        ({"base_model": "x" * 300}, "base_model 'xxx.*is neither a folder path nor a Hub repo id"),
        ({"adapter": "", "format_version": 2}, "adapter '' is neither"),
    ],
)
def test_bad_config_values_are_refused_at_load(tmp_path, changes, message):
    with pytest.raises(MaskError, match=message):
        ChannelMask.from_dir(write_config(tmp_path / "m", **changes))


def test_head_dim_zero_tensor_is_refused(tmp_path):
    from safetensors.torch import save_file

    folder = write_config(tmp_path / "m", head_dim=0)
    save_file({"keep": torch.zeros(2, 2, 0, dtype=torch.uint8)}, str(folder / MASK_FILE))
    with pytest.raises(MaskError, match="head_dim must be a positive integer"):
        ChannelMask.from_dir(folder)
    with pytest.raises(MaskError, match="empty dimension"):
        ChannelMask(keep=torch.zeros(2, 2, 0, dtype=torch.bool), ratio=0.0, align=1)


def test_oversized_config_is_refused_without_reading_it(tmp_path):
    folder = random_mask().save_pretrained(tmp_path / "m")
    with open(folder / CONFIG_FILE, "r+b") as f:
        f.truncate(200 << 20)  # 200 MB (sparse): refused by its size
    with pytest.raises(MaskError, match=r"209,715,200 bytes; a mask's config.json may hold at most 1,048,576"):
        ChannelMask.from_dir(folder)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "folder"])
def test_non_regular_files_are_named_not_missing(tmp_path, kind):
    folder = random_mask().save_pretrained(tmp_path / "m")
    name = MASK_FILE if kind == "dev-zero" else CONFIG_FILE
    (folder / name).unlink()
    if kind == "dev-zero":
        (folder / name).symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(folder / name)
    else:
        (folder / name).mkdir()
    result: list[BaseException | None] = []

    def load() -> None:
        try:
            ChannelMask.from_dir(folder)
            result.append(None)
        except BaseException as e:  # noqa: BLE001
            result.append(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(10)
    assert result, "loading hung"  # a FIFO must not block the reader
    assert isinstance(result[0], MaskError) and "not a regular file" in str(result[0])
    assert {"dev-zero": "device", "fifo": "pipe", "folder": "folder"}[kind] in str(result[0])


def test_gguf_file_must_stay_inside_the_model_folder(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "secret.gguf").write_text("x")
    (tmp_path / "model" / "link.gguf").symlink_to(tmp_path / "secret.gguf")
    for name in ("../secret.gguf", "/etc/passwd", "link.gguf", "a/../../secret.gguf"):
        with pytest.raises(BaseModelError, match="loader.gguf_file"):
            resolve_base_model(str(tmp_path / "model"), {"gguf_file": name})
    assert resolve_base_model(str(tmp_path / "model"), {"gguf_file": "m.gguf"})[1] == {"gguf_file": "m.gguf"}


# ---- Also: the CLIs' bad arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (["eval", "M", "--lengths", "0"], "--lengths: must be at least 1, got 0"),
        (["eval", "M", "--lengths", "-5"], "--lengths: must be at least 1, got -5"),
        (["eval", "M", "--samples", "0"], "--samples: must be at least 1, got 0"),
        (["bench", "M", "--contexts", "0"], "--contexts: must be at least 1, got 0"),
        (["bench", "M", "--contexts", "abc"], "--contexts: 'abc' is not an integer"),
        (["bench", "M", "--batches", "-2"], "--batches: must be at least 1, got -2"),
        (["bench", "M", "--threads", "-1"], "--threads: must be at least 1"),
        (["bench", "M", "--device", "gpu9"], "--device: 'gpu9' is not a torch device"),
        (["bench", "--estimate", "x", "--ratio", "2"], "--ratio: must be in"),
        (["generate", "M", "--prompt", "a\udcff b"], "--prompt: not valid text: character 1"),
        (["generate", "M", "--prompt", "x", "--max-new-tokens", "0"], "--max_new_tokens: must be at least 1"),
        (["run", "recipes/smollm2-135m.yaml", "--stage2.steps", "x"], "--stage2.steps: Expected a <class 'int'>"),
        (["run", "recipes/smollm2-135m.yaml", "--stage", "3"], "--stage: 3 is not one of 1, 2"),
        (["memory", "m", "--context", "0"], "--context: must be at least 1, got 0"),
        (["memory", "../../no-such-model"], "'../../no-such-model': cannot read its config"),
        (["fit", "--trainer.max_steps", "x"], "--trainer.max_steps: Expected a <class 'int'>"),
        (["eval", "M", "--methods", "full", "oracle"], "--methods: oracle is not one of"),
    ],
)
def test_bad_cli_arguments_exit_2_with_one_line(capsys, monkeypatch, args, message):
    monkeypatch.chdir(ROOT)
    code, err = cli(args, capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_bench_missing_base_model_and_bad_estimate(tmp_path, capsys):
    mask = random_mask()
    mask.base_model = str(tmp_path / "no-such-model")
    mask.save_pretrained(tmp_path / "m")
    code, err = cli(["bench", str(tmp_path / "m"), "--contexts", "8", "--batches", "1"], capsys)
    assert code == 2 and "no-such-model" in err and err.count("\n") == 1
    for target in ("../../etc", str(tmp_path / "m")):  # not a repo id; a folder without a model config
        code, err = cli(["bench", "--estimate", target], capsys)
        assert code == 2 and "--estimate" in err and err.count("\n") == 1, err


def test_push_offline_and_to_a_bad_repo_id(tmp_path, monkeypatch, capsys):
    folder = random_mask().save_pretrained(tmp_path / "m")
    for repo_id in ("../../x", "a" * 500, ""):
        code, err = cli(["push", str(folder), repo_id], capsys)
        assert code == 2 and "leank push: error:" in err and err.count("\n") == 1, err
    code, err = cli(["push", str(folder), "org/name", "--revision", "../x"], capsys)
    assert code == 2 and "contains '..'" in err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, err = cli(["push", str(folder), "org/name"], capsys)
    assert code == 2 and "offline mode is on" in err


@pytest.mark.parametrize("content", [b"\x00\xff\xfe binary", b"- a\n- b\n", None, b"a: [1\n"],
                         ids=["binary", "yaml-list", "missing", "bad-yaml"])
def test_run_refuses_a_bad_recipe_file(tmp_path, capsys, content):
    path = tmp_path / "recipe.yaml"
    if content is not None:
        path.write_bytes(content)
    code, err = cli(["run", str(path)], capsys)
    message = {b"\x00\xff\xfe binary": "is not UTF-8 text", b"- a\n- b\n": "holds a YAML list",
               None: "no such file", b"a: [1\n": "is not valid YAML"}[content]
    assert code == 2 and message in err and "no 'stage1:' section" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if content is None else ["recipe.yaml"])


def _dump(path: Path, stage: int) -> str:
    """Stage ``stage`` of the recipe at ``path`` as the LightningCLI config `leank run` runs (YAML text)."""
    from leank_train.pipeline import load_recipe
    from leank_train.recipe import stage_config

    return yaml.safe_dump(stage_config(load_recipe(path), stage))


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "unpickled"))


def test_a_malicious_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    from test_faults import base_model, recipe

    base = base_model(tmp_path / "base")
    path = recipe(tmp_path / "r", base)
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.ckpt"
    evil.write_bytes(pickle.dumps({"state_dict": {}, "x": _Payload(str(marker))}))
    stage1 = tmp_path / "stage1.yaml"
    stage1.write_text(_dump(path, 1))
    code, err = cli(["fit", "--config", str(stage1), "--ckpt_path", str(evil)], capsys)
    assert code == 2 and "not loaded" in err and err.count("\n") == 1, err
    assert not marker.exists()


# ---- Also: a damaged de-quantised copy in the leank cache is rebuilt --------------------------------------------
def test_a_truncated_cached_copy_is_detected_and_rebuilt(fake_embedded):
    import leank_infer.model.loading as loading

    copy = fake_embedded()
    assert copy_problem(copy) is None
    weights = copy / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 100)
    assert "when it was written" in copy_problem(copy)
    with pytest.warns(UserWarning, match="damaged.*rebuilding"):
        again = fake_embedded()
    assert again == copy and weights.stat().st_size == size and copy_problem(copy) is None
    (copy / "tokenizer.json").write_text('{"tr')
    assert "tokenizer.json is 4 bytes, 2 when it was written" in copy_problem(copy)
    # a copy without its records (an older leank's, or copied by hand) is never trusted: it is rebuilt
    (copy / loading.COPY_MANIFEST).unlink()
    assert "no .leank-copy.json" in copy_problem(copy)
    with pytest.warns(UserWarning, match="damaged.*rebuilding"):
        fake_embedded()
    assert copy_problem(copy) is None and (copy / "tokenizer.json").read_text() == "{}"
    assert sorted(p.name for p in copy.parent.iterdir()) == [copy.name]  # nothing half-written left beside it



def test_a_malicious_last_ckpt_stops_leank_run_in_one_line(tmp_path, capsys):
    """``leank run`` resumes from ``<checkpoints>/<fingerprint>/last.ckpt``: a planted one is refused, named."""
    from test_faults import base_model, recipe

    from leank_train.cli import run_cli
    from leank_train.pipeline import stage_fingerprint

    base = base_model(tmp_path / "base")
    path = recipe(tmp_path / "r", base)
    probe = run_cli(["--config", _dump(path, 1)], run=False)  # the stage's resolved config, as run does
    cfg = yaml.safe_load(probe.parser.dump(probe.config, skip_none=False))
    last = tmp_path / "r" / "runs" / "checkpoints" / "stage1" / stage_fingerprint(cfg) / "last.ckpt"
    last.parent.mkdir(parents=True)
    marker = tmp_path / "pwned"
    last.write_bytes(pickle.dumps({"state_dict": {}, "x": _Payload(str(marker))}))
    capsys.readouterr()
    code = leank(["run", str(path)])
    last_line = capsys.readouterr().err.strip().splitlines()[-1]  # after Lightning's INFO lines
    assert code == 2 and last_line.startswith(f"leank run: error: checkpoint {last} holds more than tensors")
    assert not marker.exists() and not (tmp_path / "r" / "stage1").exists()


def test_export_card_names_the_target_folder_and_keeps_the_results(tmp_path):
    """The card's usage snippet loads the folder by its final path (not the temporary sibling it was built
    in), and the evaluation rows given go to eval.json and the card."""
    from leank_train.export import write_mask_repo

    rows = [{"dataset": "needle-1k", "value": 0.5}]
    repo = write_mask_repo(random_mask(seed=1), tmp_path / "repo", eval_results=rows)
    card = (repo / "README.md").read_text()
    assert str(tmp_path / "repo") + '"' in card or str(tmp_path / "repo") + "'" in card, card
    assert json.loads((repo / "eval.json").read_text())["results"] == rows and "needle-1k" in card
