"""Mask repos on the Hub: push and pull through huggingface_hub against a local Hub stand-in.

Every test talks to ``tests/hub_server.FakeHub`` on 127.0.0.1 with a dummy token and its own
Hub cache; connections anywhere else are refused, so nothing here can reach the real network.
"""

from __future__ import annotations

import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hub_server import FakeHub

from leank_infer import ChannelMask
from leank_infer.cli import main as leank
from leank_infer.mask import MASK_FILE, MaskError

REPO = "tester/leank-smollm2"
CARD_FILES = {"mask.safetensors", "config.json", "README.md", "eval.json", "pattern.png"}


def make_mask(seed: int, base: str = "HuggingFaceTB/SmolLM2-135M-Instruct") -> ChannelMask:
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(3, 2, 16, generator=g)
    return ChannelMask.from_scores(
        scores, 0.5, 4, base_model=base, recipe=f"seed: {seed}\n", sink_size=4, recent_size=8, accumu_size=4
    )


def assert_same(a: ChannelMask, b: ChannelMask) -> None:
    assert torch.equal(a.keep, b.keep)
    assert (a.scores is None and b.scores is None) or torch.equal(a.scores, b.scores)
    assert a.to_config() == b.to_config()


@pytest.fixture(scope="module")
def card_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full mask repo folder (mask, config, card, plot), written once per module."""
    from leank_infer.hub.card import write_model_card

    folder = tmp_path_factory.mktemp("mask-repo")
    make_mask(0).save_pretrained(folder)
    write_model_card(folder, eval_results=[{"dataset": "needle-1k", "value": 0.5}], repo=REPO)
    return folder


@pytest.fixture
def folder(card_folder: Path, tmp_path: Path) -> Path:
    """A private copy of :func:`card_folder` for one test."""
    return Path(shutil.copytree(card_folder, tmp_path / "mask-repo"))


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A running FakeHub that huggingface_hub talks to by default, a fresh Hub cache and a dummy token."""
    from huggingface_hub import constants

    real_create_connection = socket.create_connection

    def loopback_only(address, *args, **kwargs):
        if address[0] not in ("127.0.0.1", "localhost", "::1"):
            raise ConnectionRefusedError(f"tests must not touch the network (tried {address[0]})")
        return real_create_connection(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", loopback_only)
    with FakeHub() as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 5)
        monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 5)
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HF_TOKEN", "hf_leank_dummy_token")
        yield server


def api():
    from huggingface_hub import HfApi

    return HfApi()


def hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def titles(revision: str = "main") -> list[str]:
    return [c.title for c in api().list_repo_commits(REPO, revision=revision)]


# ---- push and pull ------------------------------------------------------------------------------
def test_push_uploads_the_folder_in_one_commit(hub: FakeHub, folder: Path) -> None:
    mask = ChannelMask.from_dir(folder)
    info = mask.push_to_hub(REPO, folder=folder, commit_message="first mask")
    # a new repo: the Hub's initial commit, then exactly one commit with all five files
    assert titles() == ["first mask", "initial commit"]
    repo = hub.repos[REPO]
    head = repo.commits[info.oid]
    assert repo.branches["main"] == info.oid
    assert set(head.files) - set(repo.commits[head.parent].files) == CARD_FILES
    assert {n: head.files[n] for n in CARD_FILES} == {n: (folder / n).read_bytes() for n in CARD_FILES}
    assert info.startswith(f"{hub.url}/{REPO}/commit/")

    # a second push adds exactly one commit; an unchanged push adds none
    info2 = make_mask(1).push_to_hub(REPO, commit_message="second mask")
    assert titles() == ["second mask", "first mask", "initial commit"]
    again = make_mask(1).push_to_hub(REPO, commit_message="same again")
    assert again.oid == info2.oid and len(titles()) == 3
    # a push without a folder writes its own card (pointing at this repo) and plot
    files = hub.repos[REPO].commits[info2.oid].files
    assert set(files) == CARD_FILES | {".gitattributes"} and files["pattern.png"] != head.files["pattern.png"]
    assert f'LeanKModel.from_pretrained("{REPO}")' in files["README.md"].decode()


def test_pull_round_trip_and_revisions(hub: FakeHub, folder: Path) -> None:
    first = ChannelMask.from_dir(folder)
    old = first.push_to_hub(REPO, folder=folder)
    api().create_tag(REPO, tag="v1", revision=old.oid)
    second, third = make_mask(1), make_mask(2)
    second.push_to_hub(REPO)
    exp = third.push_to_hub(REPO, revision="exp", commit_message="experiment")

    assert_same(ChannelMask.from_pretrained(REPO), second)  # main
    assert_same(ChannelMask.from_pretrained(REPO, revision=old.oid), first)  # an older commit
    assert_same(ChannelMask.from_pretrained(REPO, revision="v1"), first)  # a tag
    assert_same(ChannelMask.from_pretrained(REPO, revision="exp"), third)  # a branch
    assert titles("exp")[0] == "experiment" and exp.oid not in {c.oid for c in hub.repos[REPO].history("main")}

    # the Hub cache: snapshots by commit, refs for branch and tag, blobs by git id
    storage = Path(hub_cache()) / "models--tester--leank-smollm2"
    assert (storage / "refs" / "v1").read_text() == old.oid
    assert (storage / "snapshots" / old.oid / "README.md").is_file()
    # a second pull of a pinned commit is served from the cache without a request
    before = len(hub.requests)
    assert_same(ChannelMask.from_pretrained(REPO, revision=old.oid), first)
    assert len(hub.requests) == before


def test_endpoint_and_token_are_threaded_through(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    nowhere = "http://192.0.2.1:9"  # the default endpoint is unreachable: only endpoint= can work
    monkeypatch.setattr(constants, "ENDPOINT", nowhere)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", nowhere + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.delenv("HF_TOKEN")
    mask = make_mask(3)
    info = mask.push_to_hub(REPO, private=True, endpoint=hub.url, token="hf_explicit")
    assert hub.repos[REPO].private and info.oid == hub.repos[REPO].branches["main"]
    kwargs = {"endpoint": hub.url, "token": "hf_explicit"}
    assert_same(ChannelMask.from_pretrained(REPO, **kwargs), mask)
    with pytest.raises(MaskError, match=r"'tester/leank-smollm2' at revision 'main' was not found.*private"):
        ChannelMask.from_pretrained(REPO, endpoint=hub.url, token=False, cache_dir=hub_cache() + "-other")


def test_local_folders_need_no_hub(hub: FakeHub, folder: Path) -> None:
    assert_same(ChannelMask.from_pretrained(folder), ChannelMask.from_dir(folder))
    assert_same(ChannelMask.from_pretrained(str(folder)), ChannelMask.from_dir(folder))
    assert hub.requests == []
    with pytest.raises(MaskError, match="not a folder and not a Hub repo id"):
        ChannelMask.from_pretrained("a/b/c")


# ---- the CLI ---------------------------------------------------------------------------------------
def test_cli_push_pull_round_trip(hub: FakeHub, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert leank(["push", str(folder), REPO, "--commit-message", "from the CLI"]) == 0
    url = capsys.readouterr().out.strip()
    oid = url.rsplit("/", 1)[-1]
    assert titles() == ["from the CLI", "initial commit"] and hub.repos[REPO].branches["main"] == oid

    make_mask(1).push_to_hub(REPO)
    assert leank(["pull", REPO, "--revision", oid]) == 0
    pulled = Path(capsys.readouterr().out.splitlines()[0])
    assert pulled.name == oid
    for name in CARD_FILES:
        assert (pulled / name).read_bytes() == (folder / name).read_bytes()

    cache = folder.parent / "cli-cache"
    assert leank(["pull", REPO, "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(str(cache)) and "ChannelMask(layers=3" in out
    assert_same(ChannelMask.from_dir(out.splitlines()[0]), make_mask(1))

    assert leank(["pull", "tester/missing", "--revision", "v9"]) == 2
    assert re.search(r"leank pull: error: .*'tester/missing' at revision 'v9'", capsys.readouterr().err)


def test_cli_push_refuses_a_broken_folder(hub: FakeHub, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (folder / MASK_FILE).unlink()
    assert leank(["push", str(folder), REPO]) == 2
    assert f"leank push: error: {REPO} (revision main): mask.safetensors is missing" in capsys.readouterr().err
    assert REPO not in hub.repos
    (folder / "README.md").unlink()
    make_mask(5).save_pretrained(folder)
    assert leank(["push", str(folder), REPO, "--private", "--revision", "dev"]) == 0
    assert "has no README.md" in capsys.readouterr().err
    assert hub.repos[REPO].private and titles("dev")[0].startswith("Upload LeanK mask")
    assert titles("main") == ["initial commit"]


@pytest.mark.parametrize(
    "name, kind",
    [("README.md", "link"), ("LICENSE", "link"), ("pattern.png", "link"), ("config.json", "link"),
     ("eval.json", "fifo"), ("extra.png", "folder")],
)
def test_push_publishes_only_regular_files_inside_the_folder(
    hub: FakeHub, folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, kind: str
) -> None:
    """Issue #31 H1: a card linked to a secret must not be published as the card (nor any other link)."""
    import os

    secret = tmp_path / "credentials"
    # a link to a loadable config elsewhere is refused too: only what is inside the folder is published
    secret.write_bytes((folder / name).read_bytes() if name == "config.json" else b"aws_secret_access_key = AKIA")
    (folder / name).unlink(missing_ok=True)
    if kind == "link":
        (folder / name).symlink_to(secret)
    elif kind == "fifo":
        os.mkfifo(folder / name)
    else:
        (folder / name).mkdir()
    assert leank(["push", str(folder), REPO]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"leank push: error: {REPO}") and name in err and err.count("\n") == 1, err
    assert {"link": "symlink", "fifo": "pipe", "folder": "folder"}[kind] in err
    assert REPO not in hub.repos  # nothing created, nothing uploaded
    with pytest.raises(MaskError, match=name):
        ChannelMask.from_dir(folder).push_to_hub(REPO, folder=folder)
    assert REPO not in hub.repos


def test_cli_push_hub_errors_are_one_line(hub: FakeHub, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_mask(1).push_to_hub(REPO)
    api().create_tag(REPO, tag="v1")
    assert leank(["push", str(folder), REPO, "--revision", "v1"]) == 2  # a tag is not a branch
    err = capsys.readouterr().err
    assert re.search(rf"leank push: error: {REPO} \(revision v1\): .*Revision Not Found", err)
    assert err.count("\n") == 1


def test_push_without_matplotlib_writes_the_card_alone(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if leank[train] were not installed
    with pytest.warns(UserWarning, match="pattern.png not written"):
        info = make_mask(1).push_to_hub(REPO)
    files = hub.repos[REPO].commits[info.oid].files
    assert set(files) == {".gitattributes", "mask.safetensors", "config.json", "README.md"}
    assert_same(ChannelMask.from_pretrained(REPO), make_mask(1))


# ---- offline mode and an unreachable Hub -------------------------------------------------------------
def test_offline_uses_the_populated_cache(
    hub: FakeHub, folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mask = ChannelMask.from_dir(folder)
    info = mask.push_to_hub(REPO, folder=folder)
    api().create_tag(REPO, tag="v1")
    for revision in (None, "v1", info.oid):
        ChannelMask.from_pretrained(REPO, revision=revision)  # populate the cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(hub.requests)
    for revision in (None, "v1", info.oid):
        assert_same(ChannelMask.from_pretrained(REPO, revision=revision), mask)
    assert leank(["pull", REPO]) == 0
    assert len(hub.requests) == before  # offline means no request at all

    with pytest.raises(MaskError, match=r"'tester/leank-smollm2' at revision 'v2' is not .*offline mode"):
        ChannelMask.from_pretrained(REPO, revision="v2")  # never pulled
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", hub_cache() + "-empty")
    with pytest.raises(MaskError, match=r"'tester/leank-smollm2' at revision 'main' is not .*HF_HUB_OFFLINE=1"):
        ChannelMask.from_pretrained(REPO)
    capsys.readouterr()
    assert leank(["pull", REPO]) == 2
    assert re.search("leank pull: error: .*offline mode", capsys.readouterr().err)


def test_unreachable_hub_falls_back_to_the_cache(hub: FakeHub, folder: Path) -> None:
    mask = ChannelMask.from_dir(folder)
    mask.push_to_hub(REPO, folder=folder)
    ChannelMask.from_pretrained(REPO)
    hub.stop()
    assert_same(ChannelMask.from_pretrained(REPO), mask)
    with pytest.raises(MaskError, match=r"'tester/leank-smollm2' at revision 'main' .* cannot be reached"):
        ChannelMask.from_pretrained(REPO, cache_dir=hub_cache() + "-empty")


# ---- refusals and errors ---------------------------------------------------------------------------------
def seed_repo(files: dict[str, bytes]) -> str:
    """A repo made with plain huggingface_hub calls (not leank), holding ``files``; returns the commit id."""
    from huggingface_hub import CommitOperationAdd

    api().create_repo(REPO)
    ops = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=data) for name, data in files.items()]
    return api().create_commit(REPO, ops, commit_message="seed").oid


def test_pickle_only_repo_is_refused_without_unpickling(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    def never(*args, **kwargs):
        raise AssertionError("something tried to unpickle a file from a mask repo")

    for module, name in ((torch, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(module, name, never)
    payload = b"\x80\x04\x95" + b"\0" * 64  # looks like a pickle; must never be read
    seed_repo({"pytorch_model.bin": payload, "mask.pt": payload})
    with pytest.raises(MaskError) as err:
        ChannelMask.from_pretrained(REPO)
    message = str(err.value)
    assert "'tester/leank-smollm2' at revision 'main'" in message
    assert "mask.pt, pytorch_model.bin" in message
    assert "only safetensors and JSON" in message and "never unpickles" in message
    fetched = [path for method, path in hub.requests if "/resolve/" in path]
    assert not any(path.endswith((".bin", ".pt")) for path in fetched)


@pytest.mark.parametrize(
    "files, revision, pattern",
    [
        (None, None, r"'tester/leank-smollm2' at revision 'main' was not found on the Hub"),
        (None, "v1", r"'tester/leank-smollm2' at revision 'v1' was not found on the Hub"),
        ({"config.json": b"{}", "README.md": b"# hi\n"}, None, r"'tester/leank-smollm2' at revision 'main' has no mask"),
        ({"mask.safetensors": b"x"}, "main", r"'tester/leank-smollm2' at revision 'main' has no config\.json"),
        ({"config.json": b"{}"}, "nope", r"at revision 'nope': the repo has no branch, tag or commit named 'nope'"),
        ({"config.json": b"{}"}, "0" * 40, r"at revision '0{40}': the repo has no branch, tag or commit"),
    ],
    ids=["missing-repo", "missing-repo-at-revision", "missing-mask", "missing-config", "bad-branch", "bad-commit"],
)
def test_clear_errors(hub: FakeHub, files: dict[str, bytes] | None, revision: str | None, pattern: str) -> None:
    if files is not None:
        seed_repo(files)
    with pytest.raises(MaskError, match=pattern):
        ChannelMask.from_pretrained(REPO, revision=revision)


def _hub_repo(hub: FakeHub, extra: dict[str, bytes]) -> None:
    """A repo holding a valid mask (config, mask) and ``extra`` files, committed straight into the FakeHub."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = make_mask(1).save_pretrained(Path(tmp) / "m")
        files = {name: (folder / name).read_bytes() for name in ("config.json", MASK_FILE)}
    hub.commit(hub.create_repo(REPO), "main", {**files, **extra}, [], "seed")


@pytest.mark.parametrize(
    "extra, message",
    [
        ({f"photo{i:02d}.png": b"p" * (2_500_000 + i) for i in range(40)}, "holds 42 mask repo files; a mask repo has at most 24"),
        ({MASK_FILE: b"\0" * (100 << 20)}, "mask.safetensors is 104,857,600 bytes; a mask's mask.safetensors may hold at most 67,108,864"),
        ({"README.md": b"#" * (9 << 20)}, "README.md is 9,437,184 bytes; a mask's README.md may hold at most 8,388,608"),
        ({f"p{i}.png": b"p" * (7 << 20) for i in range(15)}, "hold 110,10.* bytes together; at most 100,663,296"),
    ],
    ids=["40-pngs", "100MB-mask", "9MB-card", "105MB-of-pngs"],
)
def test_pull_checks_sizes_before_it_downloads(hub: FakeHub, extra: dict[str, bytes], message: str) -> None:
    """Issue #31 M4: the Hub's listing is checked against the limits a folder is read with; nothing is fetched."""
    _hub_repo(hub, extra)
    with pytest.raises(MaskError, match=message + r".*\(nothing was downloaded\)"):
        ChannelMask.from_pretrained(REPO)
    assert not [path for _, path in hub.requests if "/resolve/" in path]
    assert not list(Path(hub_cache()).rglob("*.png")) and not list(Path(hub_cache()).rglob(MASK_FILE))


def test_pull_fetches_top_level_mask_files_only(hub: FakeHub) -> None:
    """``*.png`` names the repo's plots, not a folder of photos below them."""
    _hub_repo(hub, {"pattern.png": b"png", **{f"photos/{i}.png": b"p" * 1000 for i in range(30)}})
    folder = ChannelMask.from_pretrained(REPO) and Path(hub_cache())
    fetched = sorted({path.rsplit("/", 1)[-1] for _, path in hub.requests if "/resolve/" in path})
    assert fetched == ["config.json", MASK_FILE, "pattern.png"]
    assert not list(folder.rglob("photos"))


def test_missing_file_is_named(hub: FakeHub) -> None:
    seed_repo({"config.json": b"{}", "README.md": b"# hi\n"})
    with pytest.raises(MaskError, match=r"has no mask\.safetensors \(files: README\.md, config\.json\)"):
        ChannelMask.from_pretrained(REPO)


# ---- the model card --------------------------------------------------------------------------------------
def test_card_metadata_survives_the_round_trip(hub: FakeHub, folder: Path) -> None:
    from huggingface_hub import ModelCard

    from leank_infer.hub.transfer import resolve_mask_dir

    ChannelMask.from_dir(folder).push_to_hub(REPO, folder=folder)
    local = ModelCard.load(folder / "README.md")
    pulled = ModelCard.load(resolve_mask_dir(REPO) / "README.md")
    remote = ModelCard.load(REPO)  # straight from the Hub through huggingface_hub
    for card in (pulled, remote):
        assert card.data.to_dict() == local.data.to_dict()
        assert card.text == local.text
    d = pulled.data.to_dict()
    assert d["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and d["library_name"] == "leank"
    assert d["model-index"][0]["results"][0]["metrics"][0]["value"] == 0.5



def test_from_pretrained_loads_the_base_model_at_the_masks_revision(hub: FakeHub, tmp_path: Path) -> None:
    """A mask pins its base model's revision: LeanKModel.from_pretrained loads those weights, not main's."""
    from test_model import tiny_repo

    from leank_infer import LeanKModel

    base = "tester/tiny-base"
    api().create_repo(base)
    _, model = tiny_repo(tmp_path / "v1")
    old = api().upload_folder(repo_id=base, folder_path=tmp_path / "v1" / "base", commit_message="v1")
    new_weights = tmp_path / "v2" / "base"
    shutil.copytree(tmp_path / "v1" / "base", new_weights)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    model.save_pretrained(new_weights)
    api().upload_folder(repo_id=base, folder_path=new_weights, commit_message="v2")
    mask = ChannelMask.from_dir(tmp_path / "v1" / "mask")
    mask.base_model = base

    def lm_head(revision):
        mask.base_revision = revision
        folder = mask.save_pretrained(tmp_path / f"mask-{revision}")
        return LeanKModel.from_pretrained(folder).model.lm_head.weight

    torch.testing.assert_close(lm_head(old.oid), -model.lm_head.weight, atol=0, rtol=0)  # the pinned commit
    torch.testing.assert_close(lm_head(None), model.lm_head.weight, atol=0, rtol=0)  # main
