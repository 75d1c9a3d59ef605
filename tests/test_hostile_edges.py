"""Issue #31, the edges: what a hostile or careless user still reached, each case one row.

The high and medium items (H1-H3, M1-M9) each have a test that fails on the bug; the low cases are
one table (:func:`test_low_cases_are_one_line`): one clear line, exit code 2, no traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Lightning adds a handler on the sys.stderr of its first import: import it now, not inside a test's capsys
import lightning  # noqa: F401
import pytest
import torch
from conftest import assert_applies_as_peft_would
from test_hostile import cli, tree
from test_model import random_mask

from leank_infer import ChannelMask
from leank_infer.cli import main as leank_main
from leank_infer.mask import CONFIG_FILE, MASK_FILE, MaskError

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- H2: a folder is a mask repo by its content, never by a file name ----------------------------------
def user_folder(tmp_path: Path, kind: str) -> Path:
    """A folder of the user's that only looks like a mask repo by its file names."""
    folder = tmp_path / kind
    folder.mkdir()
    if kind == "experiment":  # some app's config.json and a README
        (folder / CONFIG_FILE).write_text(json.dumps({"my_app": 1}))
        (folder / "README.md").write_text("# my experiment\n")
    elif kind == "photos":  # a mask file among three photos, no config
        random_mask().save_pretrained(tmp_path / "src")
        (folder / MASK_FILE).write_bytes((tmp_path / "src" / MASK_FILE).read_bytes())
        for name in ("a.png", "b.png", "c.png"):
            (folder / name).write_bytes(b"\x89PNG holiday " + name.encode())
    else:  # a config.json that is almost a mask config: leank's version, the keys of another program
        (folder / CONFIG_FILE).write_text(json.dumps({"format_version": 1, "name": "mine"}))
    return folder


def _write(how: str, folder: Path, tmp_path: Path, capsys) -> str:
    """Write a mask to ``folder`` the way ``how`` does; the error text (MaskError or the CLI's line)."""
    from leank_infer.hub.card import write_model_card
    from leank_train.export import write_mask_repo

    if how == "import --force":
        torch.save(torch.ones(2, 2, 16), tmp_path / "m.pth")
        (tmp_path / "LICENSE").write_text("MIT License\n")
        code, err = cli(["import", str(tmp_path / "m.pth"), str(folder), "--base-model", "org/m", "--force"], capsys)
        assert code == 2
        return err
    with pytest.raises(MaskError) as e:
        {"save_pretrained": lambda: random_mask().save_pretrained(folder),
         "export": lambda: write_mask_repo(random_mask(), folder),
         "card": lambda: write_model_card(folder)}[how]()
    return str(e.value)


@pytest.mark.parametrize("kind", ["experiment", "photos", "near-miss"])
@pytest.mark.parametrize("how", ["save_pretrained", "export", "import --force", "card"])
def test_a_folder_that_is_not_a_mask_repo_is_never_replaced(tmp_path, capsys, kind, how):
    folder = user_folder(tmp_path, kind)
    before = tree(folder)
    err = _write(how, folder, tmp_path, capsys)
    assert ("not a mask repo" in err or "lacks required keys" in err or "unknown format_version" in err
            or "mask.safetensors is missing" in err or "config.json is missing" in err), err
    assert tree(folder) == before
    assert sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{kind}")) == []


def test_the_refusal_says_why_the_folder_is_not_a_mask_repo(tmp_path):
    for kind, why in [("experiment", "its config.json is not a leank mask config: unknown format_version None"),
                      ("photos", "it has no config.json"),
                      ("near-miss", "lacks required keys: num_layers")]:
        with pytest.raises(MaskError, match=why):
            random_mask().save_pretrained(user_folder(tmp_path, kind))


def test_a_mask_repo_with_a_damaged_mask_file_is_still_replaced(tmp_path):
    """What makes a mask repo is its config; a damaged or missing mask.safetensors is replaced whole."""
    folder = random_mask(seed=1).save_pretrained(tmp_path / "m")
    (folder / MASK_FILE).write_bytes(b"truncated")
    random_mask(seed=2).save_pretrained(folder)
    (folder / MASK_FILE).unlink()
    random_mask(seed=3).save_pretrained(folder)
    assert torch.equal(ChannelMask.from_dir(folder).keep, random_mask(seed=3).keep)


@pytest.mark.parametrize("which", ["stage1_dir", "mask_dir"])
def test_leank_run_refuses_a_user_folder_before_it_trains(tmp_path, capsys, which):
    from test_faults import base_model, recipe

    base = base_model(tmp_path / "base")
    folder = user_folder(tmp_path / "r", "experiment") if (tmp_path / "r").mkdir() is None else None
    path = recipe(tmp_path / "r", base, {which: str(folder)})
    before = tree(folder)
    code, err = cli(["run", str(path)], capsys)
    assert code == 2 and "is a folder that is not a mask repo" in err, err
    assert tree(folder) == before
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["experiment", "recipe.yaml"]  # nothing trained


# ---- M2 and the low override cases: a mask's config_overrides are checked before any weight exists ----------
@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_hidden_layers": 300}, "no longer fits the mask: .*num_layers is 2 in the mask but 300"),
        ({"num_hidden_layers": 1000}, "no longer fits the mask"),
        ({"num_key_value_heads": 4}, "no longer fits the mask: .*num_kv_heads"),
        ({"vocab_size": 100_000}, r"change the shape of the base model.s weights \(lm_head.weight: \(128, 64\) -> \(100000, 64\), and 1 more"),
        ({"hidden_size": 128}, "change the shape of the base model's weights"),
        ({"intermediate_size": 7}, "change the shape of the base model's weights"),
        ({"hidden_act": "nope"}, "describe a model that cannot be built"),
        ({"num_attention_heads": 0}, "cannot be built|shape unreadable"),
        ({"return_dict": False}, "may not set return_dict"),
        ({"use_cache": False}, "may not set use_cache"),
        ({"output_attentions": True}, "may not set output_attentions"),
    ],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, dict) else None,
)
def test_config_overrides_are_checked_before_the_model_is_built(tmp_path, monkeypatch, overrides, message):
    import transformers
    from test_hostile import write_config
    from test_model import tiny_repo

    from leank_infer import LeanKModel

    mask_dir, _ = tiny_repo(tmp_path)
    write_config(mask_dir, format_version=3, base_model=str(tmp_path / "base"), config_overrides=overrides)

    def never(*a, **k):
        raise AssertionError("the model must not be built")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    with pytest.raises(MaskError, match=message):
        LeanKModel.from_pretrained(mask_dir)


def test_overrides_that_retune_the_model_still_load(tmp_path):
    from test_hostile import write_config
    from test_model import tiny_repo

    from leank_infer import LeanKModel

    mask_dir, _ = tiny_repo(tmp_path)
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 10000.0}
    write_config(mask_dir, format_version=3, base_model=str(tmp_path / "base"),
                 config_overrides={"rope_parameters": rope, "max_position_embeddings": 4096, "rms_norm_eps": 1e-3},
                 extra={"config_overrides_reason": "rms_norm_eps: learned on the fine-tune that uses it"})
    m = LeanKModel.from_pretrained(mask_dir)
    assert m.model.config.rope_parameters["rope_type"] == "yarn" and m.model.config.rms_norm_eps == 1e-3


# ---- M1: an adapter's regular expressions cannot hang leank ---------------------------------------------------


def _adapter(tmp_path: Path, **fields) -> tuple[Path, object]:
    """A tiny LoRA adapter over the tiny Llama, whose adapter_config.json then gets ``fields``."""
    from conftest import tiny_model
    from test_families import _lora_adapter

    base = tiny_model("llama")
    _lora_adapter(base, tmp_path / "lora")
    cfg_path = tmp_path / "lora" / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **fields}))
    return tmp_path / "lora", base


@pytest.mark.parametrize(
    "fields, message",
    [
        # the probe: `re` backtracks for hours on it; leank's bounded matcher answers at once
        ({"target_modules": "(.*.*)*y"}, r"target_modules '\(.\*.\*\)\*y' matches no module of the model"),
        # one that backtracks in the bounded matcher too: cut off at its time limit
        ({"target_modules": r"(.|\w|[a-z.])*\d\d\d"}, r"target_modules .* takes more than 2 s to match"),
        ({"exclude_modules": r"(.|\w|[a-z.])*\d\d\d"}, r"exclude_modules .* takes more than 2 s to match"),
        ({"modules_to_save": ["(.*.*)*y"]}, r"modules_to_save \['\(.\*.\*\)\*y'\] must be plain module names"),
        ({"rank_pattern": {"(a|a)*b": 2}}, "rank_pattern .* must be plain module names"),
        ({"target_modules": "nothing_here"}, "matches no module of the model"),
        ({"target_modules": "(unclosed"}, "is not a valid regular expression"),
    ],
    ids=["issue-probe", "target-backtracks", "exclude-backtracks", "modules-to-save", "rank-pattern", "no-match",
         "invalid"],
)
def test_an_adapters_patterns_are_bounded(tmp_path, alarm, fields, message):
    from leank_infer.model.loading import BaseModelError, apply_adapter

    folder, base = _adapter(tmp_path, **fields)
    alarm(30)
    with pytest.raises(BaseModelError, match=message):
        apply_adapter(base, folder)


def test_an_adapter_with_a_plain_regex_still_applies_as_peft_would(tmp_path, alarm):
    folder, base = _adapter(tmp_path, target_modules=r".*\.(q_proj|k_proj|v_proj|o_proj)")
    alarm(60)
    assert_applies_as_peft_would(folder, base)


# ---- M3 and the low .pth cases: `leank import` checks sizes before it materialises anything ---------------------
def _pth(tmp_path: Path, case: str) -> Path:
    import zipfile

    path = tmp_path / "in" / "m.pth"
    path.parent.mkdir()
    (path.parent / "LICENSE").write_text("MIT License\n")
    if case == "stride-0-view":  # 1.6 KB on disk, 10^8 elements (2 x 10^9 in the issue) once compared
        torch.save(torch.zeros(1, 1, 1, dtype=torch.uint8).expand(100, 1000, 1000), path)
    elif case == "zip-bomb":  # an 80 MB storage deflated to ~80 KB: torch's reader would inflate it
        plain = tmp_path / "plain.pth"
        torch.save(torch.zeros(80, 1000, 1000, dtype=torch.uint8), plain)
        with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w") as dst:
            for info in src.infolist():
                dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
        plain.unlink()
    elif case == "legacy":
        torch.save(torch.ones(2, 2, 16), path, _use_new_zipfile_serialization=False)
    elif case == "sparse":
        torch.save(torch.ones(2, 2, 16).to_sparse(), path)
    elif case == "meta":
        torch.save(torch.empty(2, 2, 16, device="meta"), path)
    elif case == "huge-file":
        torch.save(torch.ones(2, 2, 16), path)
        with open(path, "r+b") as f:
            f.truncate(100 << 20)  # sparse on disk
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("stride-0-view", "the tensor has 100,000,000 elements; a mask has at most 67,108,864"),
        ("zip-bomb", "is compressed; torch.save stores its entries as they are"),
        ("legacy", "not a torch.save zip archive"),
        ("sparse", "got a torch.sparse_coo tensor"),
        ("meta", "tensor on meta"),
        ("huge-file", "is 104,857,600 bytes; a mask file is at most 67,108,864"),
    ],
)
def test_import_checks_sizes_before_it_loads(tmp_path, capsys, case, message):
    src = _pth(tmp_path, case)
    code, err = cli(["import", str(src), str(tmp_path / "out"), "--base-model", "org/m"], capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


# ---- M5: the de-quantised copy is checked by content, not size alone ------------------------------------------


@pytest.mark.parametrize("damage", ["header-byte", "weights-0xff"])
def test_a_cached_copy_damaged_in_place_is_rebuilt(fake_embedded, monkeypatch, damage):
    import leank_infer.model.loading as loading

    copy = fake_embedded()
    weights = copy / "model.safetensors"
    good, size = weights.read_bytes(), weights.stat().st_size
    assert loading.copy_problem(copy) is None
    with open(weights, "r+b") as f:  # the size stays: only the content tells
        if damage == "header-byte":
            f.seek(20)
            f.write(bytes([good[20] ^ 0x20]))
        else:
            f.seek(size // 4)
            f.write(b"\xff" * (size // 2))
    assert weights.stat().st_size == size
    monkeypatch.setattr(loading, "_VERIFIED", {}, raising=False)  # a new process
    assert "model.safetensors does not hash to what was written" in loading.copy_problem(copy)
    with pytest.warns(UserWarning, match="damaged.*rebuilding"):
        assert fake_embedded() == copy
    assert weights.read_bytes() == good and loading.copy_problem(copy) is None




def test_the_hashes_are_checked_once_per_process(fake_embedded, monkeypatch):
    import leank_infer.model.loading as loading

    copy = fake_embedded()
    calls = []
    real = loading._sha256
    monkeypatch.setattr(loading, "_sha256", lambda p: calls.append(p.name) or real(p))
    for _ in range(3):
        assert fake_embedded() == copy
    assert sorted(calls) == sorted(json.loads((copy / loading.COPY_HASHES).read_text()))  # each file once


# ---- LEANK_CACHE: one function decides where the cache is, and says why a value cannot work ----------------------
@pytest.mark.parametrize(
    "value, message",
    [
        ("relative/cache", "LEANK_CACHE='relative/cache' is a relative path"),
        ("FILE", "exists and is not a folder"),
        ("FILE/sub", "cannot make the folder"),
        ("READ-ONLY", "is read-only for this user"),
    ],
)
def test_a_leank_cache_that_cannot_work_is_one_clear_error(tmp_path, monkeypatch, capsys, value, message):
    import leank_infer.folders.cache_root as where

    (tmp_path / "file").write_text("x")
    (tmp_path / "ro").mkdir()
    if value == "READ-ONLY":  # what a non-root user sees in a folder without write permission (tests may run as root)
        real = os.access
        monkeypatch.setattr(where.os, "access", lambda p, mode: False if Path(p) == tmp_path / "ro" else real(p, mode))
    value = {"FILE": str(tmp_path / "file"), "FILE/sub": str(tmp_path / "file" / "sub"),
             "READ-ONLY": str(tmp_path / "ro")}.get(value, value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LEANK_CACHE", value)
    with pytest.raises(where.CacheRootError, match=message):
        where.cache_root()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mask = Path(__file__).resolve().parent.parent / "hub" / "smollm2-135m-instruct"  # on the embedded model
    code, err = cli(["generate", str(mask), "--prompt", "hi"], capsys)  # whose de-quantised copy needs the cache
    assert code == 2 and message.replace("\\", "") in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "ro"]  # nothing written anywhere


def test_an_empty_leank_cache_is_the_default_not_the_current_folder(tmp_path, monkeypatch):
    from leank_infer.folders.cache_root import cache_root

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for value in ("", "  "):
        monkeypatch.setenv("LEANK_CACHE", value)
        assert cache_root() == tmp_path / "home" / ".cache" / "leank"
    monkeypatch.setenv("LEANK_CACHE", "~/elsewhere")
    assert cache_root() == tmp_path / "home" / "elsewhere"


def test_a_read_only_cache_with_a_good_copy_is_still_used(fake_embedded, monkeypatch):
    import leank_infer.folders.cache_root as where
    import leank_infer.model.loading as loading

    copy = fake_embedded()
    monkeypatch.setattr(where.os, "access", lambda p, mode: False)
    monkeypatch.setattr(loading, "_VERIFIED", {}, raising=False)
    assert fake_embedded() == copy
    (copy / "model.safetensors").unlink()
    with pytest.raises(loading.BaseModelError, match="is read-only for this user"):  # a rebuild would write
        fake_embedded()


# ---- M6: recipe inputs that hung or blew up ------------------------------------------------------------------
def _anchor_bomb() -> str:
    """The 'billion laughs' of YAML: nine levels of nine aliases, 9^9 nodes once expanded, ~500 bytes."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "case, message",
    [
        ("fifo-include", "is not a regular file"),
        ("fifo-recipe", "is not a regular file"),
        ("anchor-bomb", "expands to 490,329,064 YAML nodes through its aliases"),
        ("bomb-include", "expands to 490,329,064 YAML nodes"),
        ("include-loop", "its config: includes loop"),
        ("secret-as-config", "is not valid YAML: "),
        ("dev-zero-recipe", "is not a regular file"),
    ],
)
def test_a_recipe_file_that_would_hang_or_blow_up_is_one_line(tmp_path, capsys, alarm, case, message):
    recipe = tmp_path / "recipe.yaml"
    if case in ("fifo-include", "fifo-recipe"):
        os.mkfifo(tmp_path / "fifo.yaml")
        recipe.write_text("config: fifo.yaml\nout_dir: x\n")
        if case == "fifo-recipe":
            recipe = tmp_path / "fifo.yaml"
    elif case == "anchor-bomb":
        recipe.write_text(_anchor_bomb())
        assert len(_anchor_bomb()) < 600
    elif case == "bomb-include":
        (tmp_path / "bomb.yaml").write_text(_anchor_bomb())
        recipe.write_text("config: bomb.yaml\n")
    elif case == "include-loop":
        recipe.write_text("config: other.yaml\n")
        (tmp_path / "other.yaml").write_text("config: recipe.yaml\n")
    elif case == "secret-as-config":  # a mistaken --config /etc/shadow: named, never printed
        recipe.write_text("root: $6$hunter2hash\n  password: [hunter2\n")
    else:
        recipe = Path("/dev/zero")
    alarm(20)
    args = ["run", "--config", str(recipe)] if case == "secret-as-config" else ["run", str(recipe)]
    code, err = cli(args, capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert "hunter2" not in err
    code, err = cli(["fit", "--config", str(recipe)], capsys)  # a stage config: the same checks
    assert code == 2 and message in err and "hunter2" not in err, err


@pytest.mark.parametrize("case", ["dev-zero", "fifo", "root-folder", "fifo-in-folder", "deep-folder"])
def test_a_haystack_that_would_hang_or_blow_up_is_refused(tmp_path, alarm, case):
    from leank_train.data.haystack import haystack_text
    from leank_train.errors import RecipeError

    if case in ("fifo", "fifo-in-folder"):
        (tmp_path / "h").mkdir()
        os.mkfifo(tmp_path / "h" / "a.txt")
    if case == "deep-folder":  # text only below the folder: not read (a folder's own *.txt are)
        (tmp_path / "h" / "sub").mkdir(parents=True)
        (tmp_path / "h" / "sub" / "a.txt").write_text("deep")
    spec = {"dev-zero": "/dev/zero", "fifo": str(tmp_path / "h" / "a.txt"), "root-folder": "/"}.get(
        case, str(tmp_path / "h"))
    alarm(20)
    with pytest.raises(RecipeError, match="not a regular file|holds no \\*.txt file"):
        haystack_text(spec)


def test_a_haystack_file_is_read_only_as_far_as_needed(tmp_path, monkeypatch):
    from leank_train.data.haystack import haystack_text

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(4 << 30)  # 4 GB of zeros, sparse on disk: reading it whole would take gigabytes
    assert len(haystack_text(str(big), max_chars=1000)) == 1000
    (tmp_path / "h").mkdir()
    for name in ("a", "b", "c"):
        (tmp_path / "h" / f"{name}.txt").write_text(name * 600)
    assert haystack_text(str(tmp_path / "h"), max_chars=1000) == "a" * 600 + " " + "b" * 399


# ---- M7: the whole recipe is checked before the first step ------------------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (["--stage1.steps", "-1"], "--stage1.steps: must be at least 1, got -1"),
        (["--stage2.steps", "0"], "--stage2.steps: must be at least 1, got 0"),
        (["--sink_size", "-1"], "--sink_size: must be at least 0, got -1"),
        (["--decode_recent_size", "-1"], "--decode_recent_size: must be at least 0, got -1"),
        (["--accumu_size", "0"], "--accumu_size: must be at least 1, got 0"),
        (["--sink_size", str(2**31)], "--sink_size: must be at most 2,147,483,647"),
        (["--stage1.lr", "0"], "--stage1.lr: must be above 0"),
        (["--ratio", "1.0"], "--ratio: must be in [0, 1)"),
        (["--min_length", "500", "--max_length", "100"], "--max_length: must be at least --min_length (500)"),
    ],
)
def test_leank_run_checks_the_whole_recipe_before_it_trains(tmp_path, capsys, args, message):
    from test_faults import base_model, recipe

    base = base_model(tmp_path / "base")
    path = recipe(tmp_path / "r", base)
    code, err = cli(["run", str(path), *args], capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["recipe.yaml"]  # nothing loaded, trained, written


def test_the_committed_recipes_pass_the_recipe_checks():
    from leank_train.pipeline import load_recipe
    from leank_train.recipe_checks import recipe_problems

    recipes = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))
    assert recipes and {p.name: recipe_problems(load_recipe(p)) for p in recipes} == {p.name: [] for p in recipes}


# ---- M9 and the low output cases: outputs are checked before the run and never land inside a mask folder -----------
EVAL = ["--lengths", "40", "--samples", "1", "--kinds", "passkey", "--methods", "full", "leank", "--seed", "0",
        "--no-kl"]


@pytest.mark.parametrize(
    "flag, where, message",
    [
        ("--json", "MASK/config.json", "is inside the mask folder"),
        ("--json", "MASK/notes.json", "is inside the mask folder"),
        ("--plot", "MASK/acc.png", "is inside the mask folder"),  # without --card nothing takes it in
        ("--json", "TMP/no/such/folder/r.json", "there is no folder"),
        ("--plot", "TMP/no/such/folder/a.png", "there is no folder"),
        ("--plot", "TMP/acc.pdf", "must end in .png"),
        ("--json", "TMP", "is a folder; give a file name"),
    ],
)
def test_eval_outputs_are_checked_before_the_run(tmp_path, capsys, monkeypatch, flag, where, message):
    from test_model import tiny_repo

    import leank_train.evaluate as ev

    mask_dir, _ = tiny_repo(tmp_path)
    before = tree(mask_dir)
    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: pytest.fail("the run started"))
    path = where.replace("MASK", str(mask_dir)).replace("TMP", str(tmp_path))
    code, err = cli(["eval", str(mask_dir), *EVAL, flag, path], capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert tree(mask_dir) == before and ChannelMask.from_dir(mask_dir) is not None


def test_bench_plot_is_checked_before_the_run(tmp_path, capsys, monkeypatch):
    from test_model import tiny_repo

    import leank_infer.bench as bench

    mask_dir, _ = tiny_repo(tmp_path)
    monkeypatch.setattr(bench, "load_mask_base_model", lambda *a, **k: pytest.fail("the run started"))
    for path, message in [(tmp_path / "no" / "x.png", "there is no folder"), (mask_dir / "t.png", "inside the mask")]:
        code, err = cli(["bench", str(mask_dir), "--contexts", "8", "--batches", "1", "--plot", str(path)], capsys)
        assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_plot_into_the_mask_folder_goes_in_through_the_card_swap(tmp_path, capsys):
    """`--plot MASK/acc.png --card` (the README's command) still works: the plot is drawn elsewhere and the card
    update's swap brings it in; nothing is written into the live folder."""
    from test_model import tiny_repo

    mask_dir, _ = tiny_repo(tmp_path)
    inode = mask_dir.stat().st_ino
    code, err = cli(["eval", str(mask_dir), *EVAL, "--plot", str(mask_dir / "acc.png"), "--card"], capsys)
    assert code == 0, err
    assert (mask_dir / "acc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and mask_dir.stat().st_ino != inode
    assert "![acc.png](acc.png)" in (mask_dir / "README.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "mask"]


# ---- the low cases: one row each, one clear line (exit 2, no traceback) or the right behaviour ----------------------
def _mask_with(tmp_path: Path, **changes) -> Path:
    from test_hostile import write_config
    from test_model import tiny_repo

    mask_dir, _ = tiny_repo(tmp_path)
    return write_config(mask_dir, **{"base_model": str(tmp_path / "base"), **changes}) if changes else mask_dir


def _proc_self_mem(tmp_path, monkeypatch, capsys):
    mask_dir = _mask_with(tmp_path)
    (mask_dir / MASK_FILE).unlink()
    (mask_dir / MASK_FILE).symlink_to("/proc/self/mem")  # a stranger's folder can hold this link
    return cli(["generate", str(mask_dir), "--prompt", "w5"], capsys), "mask.safetensors cannot be read"


def _glob_gguf(tmp_path, monkeypatch, capsys):
    mask_dir = _mask_with(tmp_path, loader={"gguf_file": "*.gguf"})
    return cli(["generate", str(mask_dir), "--prompt", "w5"], capsys), "must name one file (no glob characters"


def _bench_huge_batch(tmp_path, monkeypatch, capsys):
    mask_dir = _mask_with(tmp_path)
    monkeypatch.setattr("leank_infer.bench.free_bytes", lambda device: 1 << 30)  # the same on every machine
    args = ["bench", str(mask_dir), "--contexts", "64", "--batches", "1", "100000", "--new-tokens", "4"]
    # 512 bytes a token (2 layers x 2 KV heads x 16 channels, K and V, fp32) x 68 tokens x 100,000 sequences
    return cli(args, capsys), "--batches 100,000 x --contexts 64 (+4 new tokens) needs 3.2 GiB of dense K/V cache, " \
        "more than the 1.0 GiB free on cpu"


def _bench_huge_batch_real(tmp_path, monkeypatch, capsys):
    mask_dir = _mask_with(tmp_path)  # 16 KiB a token: 10^7 sequences of 4k tokens exceed any machine's memory
    args = ["bench", str(mask_dir), "--contexts", "4000", "--batches", "10000000", "--new-tokens", "4"]
    return cli(args, capsys), "of dense K/V cache, more than the"


def _bench_meta(tmp_path, monkeypatch, capsys):
    return cli(["bench", str(_mask_with(tmp_path)), "--device", "meta"], capsys), "--device: leank bench measures on cpu"


def _damaged_last_ckpt(tmp_path, monkeypatch, capsys):
    import yaml
    from test_faults import base_model, recipe
    from test_hostile import _dump

    from leank_train.cli import run_cli
    from leank_train.pipeline import stage_fingerprint

    base = base_model(tmp_path / "base")
    path = recipe(tmp_path / "r", base)
    probe = run_cli(["--config", _dump(path, 1)], run=False)
    cfg = yaml.safe_load(probe.parser.dump(probe.config, skip_none=False))
    last = tmp_path / "r" / "runs" / "checkpoints" / "stage1" / stage_fingerprint(cfg) / "last.ckpt"
    last.parent.mkdir(parents=True)
    torch.save({"state_dict": {"alpha": torch.ones(3)}}, last)
    last.write_bytes(last.read_bytes()[:-40])  # killed while writing: cut short
    capsys.readouterr()
    code = leank_main(["run", str(path)])
    err = capsys.readouterr().err.strip().splitlines()[-1] + "\n"  # after Lightning's INFO lines
    return (code, err), "is damaged (not a whole zip archive"


def _memory_three_kv_heads(tmp_path, monkeypatch, capsys):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=3, head_dim=16, vocab_size=128).save_pretrained(tmp_path / "m")
    code, err = cli(["memory", str(tmp_path / "m")], capsys)  # the default --sp 1 2 8
    assert code == 0
    return cli(["memory", str(tmp_path / "m"), "--sp", "2", "8"], capsys), "--sp: none of 2, 8 divides the model's 3 KV"


def _bad_backend(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LEANK_BACKEND", "nope")
    return cli(["generate", str(_mask_with(tmp_path)), "--prompt", "w5"], capsys), "LEANK_BACKEND must be one of"


def _bad_eval_json(tmp_path, monkeypatch, capsys):
    import leank_train.evaluate as ev

    mask_dir = _mask_with(tmp_path)
    (mask_dir / "eval.json").write_text('{"results": [1, 2')
    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: pytest.fail("the run started"))
    return cli(["eval", str(mask_dir), *EVAL, "--card"], capsys), "eval.json is not valid JSON"


def _disk_full(tmp_path, monkeypatch, capsys):
    import errno

    import safetensors.torch

    folder = random_mask(seed=1).save_pretrained(tmp_path / "m")
    before = tree(folder)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(MaskError) as e:
        random_mask(seed=2).save_pretrained(folder)
    assert tree(folder) == before and sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    return (2, f"leank: error: {e.value}\n"), "cannot write " + str(folder) + ": No space left on device (nothing was"


def _revision_of_a_folder(tmp_path, monkeypatch, capsys):
    args = ["generate", str(_mask_with(tmp_path)), "--prompt", "w5", "--revision", "v1"]
    return cli(args, capsys), "is a local folder, which has no revisions"


def _escape_sequences(tmp_path, monkeypatch, capsys):
    mask_dir = _mask_with(tmp_path, base_model="\x1b[2J\x1b[31mowned")
    (code, err) = cli(["generate", str(mask_dir), "--prompt", "w5"], capsys)
    assert "\x1b" not in err
    return (code, err), "base_model '\\x1b[2J\\x1b[31mowned' is neither a folder path"


LOW_CASES = {
    "proc-self-mem-as-mask-file": _proc_self_mem,
    "glob-as-gguf_file": _glob_gguf,
    "bench---batches-100000": _bench_huge_batch,
    "bench---batches-beyond-this-machine": _bench_huge_batch_real,
    "bench---device-meta": _bench_meta,
    "damaged-last.ckpt": _damaged_last_ckpt,
    "memory-3-kv-heads": _memory_three_kv_heads,
    "LEANK_BACKEND=nope": _bad_backend,
    "malformed-eval.json-with---card": _bad_eval_json,
    "disk-full-during-export": _disk_full,
    "--revision-of-a-local-folder": _revision_of_a_folder,
    "terminal-escapes-in-base_model": _escape_sequences,
}


@pytest.mark.parametrize("case", list(LOW_CASES))
def test_low_cases_are_one_line(tmp_path, monkeypatch, capsys, case):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (code, err), message = LOW_CASES[case](tmp_path, monkeypatch, capsys)
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_sizes_of_2_31_minus_1_decode_as_dense_without_allocating_them():
    """A mask may say "never prune" with sink/recent of 2^31-1: the cache preallocates at most the model's positions."""
    from conftest import tiny_model

    from leank_infer import LeanKModel

    model = tiny_model("llama")
    big = 2**31 - 1
    mask = ChannelMask.from_scores(torch.rand(2, 2, 16), 0.5, 4, sink_size=big, recent_size=big, accumu_size=big)
    lk = LeanKModel(model, mask)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = lk.new_cache()
    out = lk.generate(ids, max_new_tokens=3, do_sample=False, past_key_values=cache)
    with lk.dense():
        assert torch.equal(out, model.generate(ids, max_new_tokens=3, do_sample=False))
    assert cache.allocated_bytes() < 3 * 4096 * 2 * 2 * 16 * 4 * 2  # K+V of the model's 4096 positions, 3x slack


def test_the_default_bench_fits_the_embedded_model():
    """The default contexts plus the default new tokens fit SmolLM2's 8,192 positions (8,192 + 32 did not)."""
    import inspect

    from leank_infer.bench import bench

    params = inspect.signature(bench).parameters
    assert max(params["contexts"].default) + params["new_tokens"].default <= 8192


def test_a_tilde_in_the_recipes_paths_is_the_home_folder(tmp_path, monkeypatch):
    from leank_train.pipeline import load_recipe

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = Path(__file__).resolve().parent.parent / "recipes" / "smollm2-135m.yaml"
    r = load_recipe(path, ["--out_dir", "~/runs/x", "--mask_dir", "~/masks/m"])
    assert (r.out_dir, r.mask_dir) == (str(tmp_path / "home" / "runs" / "x"), str(tmp_path / "home" / "masks" / "m"))
    assert r.scores_dir == str(tmp_path / "home" / "runs" / "x" / "stage1-mask")


def test_a_recipe_cannot_add_markdown_to_the_card_outside_its_code_block(tmp_path):
    from leank_infer.hub.card import write_model_card

    mask = random_mask()
    mask.recipe = "out_dir: x\n```\n![tracker](https://evil.example/p.png)\n<script>x</script>\n````\n"
    folder = mask.save_pretrained(tmp_path / "m")
    write_model_card(folder)
    card = (folder / "README.md").read_text()
    block = card.split("## Recipe", 1)[1]
    fence = block.split("\n")[4][:5]
    assert fence == "`````" and block.count("\n" + fence) == 2  # opened and closed by a fence longer than any run
    inside = block.split(fence + "yaml\n", 1)[1].split("\n" + fence, 1)[0]
    assert "![tracker]" in inside and "<script>" in inside


def test_every_promise_of_the_security_page_names_a_test_that_exists():
    """docs/security.md: one promise per bullet, each naming its tests; every test named exists (a renamed or
    deleted test leaves a promise without its test, which this catches)."""
    import ast
    import re

    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "security.md").read_text()
    promises = text.split("## What leank promises", 1)[1].split("## Not promised", 1)[0]
    bullets = [b for b in re.split(r"\n(?=- )", promises) if b.startswith("- ")]
    assert len(bullets) >= 20
    for bullet in bullets:
        assert "Test" in bullet and "`tests/" in bullet, bullet[:120]
    named = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?(?:\[[^\]]*\])?`", text)
    assert len(named) >= 30
    for path, name in named:
        assert (root / path).is_file(), path
        if name:
            tree = ast.parse((root / path).read_text())
            assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, f"{path}::{name}"
    for case in re.findall(r"test_low_cases_are_one_line\[([^\]]+)\]", text):
        assert case in LOW_CASES, case
