"""The one atomic-write helper (leank_infer.folders.atomic) and the card update that goes through it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from leank_infer import ChannelMask
from leank_infer.folders import atomic
from leank_infer.hub import card


def _mask_repo(folder: Path) -> Path:
    ChannelMask.from_scores(torch.rand(2, 2, 8, generator=torch.Generator().manual_seed(0)), ratio=0.5, align=2,
                            base_model="org/model").save_pretrained(folder)
    card.write_model_card(folder, [{"dataset": "needle-1k", "value": 0.5}])
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_card_update_swaps_the_folder_whole_and_a_failure_leaves_it(tmp_path: Path, monkeypatch) -> None:
    folder = _mask_repo(tmp_path / "repo")
    before, inode = _files(folder), folder.stat().st_ino
    plot = tmp_path / "drawn-elsewhere.png"
    plot.write_bytes(b"png")
    card.write_model_card(folder, figures={plot.name: "leank eval repo --plot x"}, figure_files=[plot])
    after = _files(folder)
    assert folder.stat().st_ino != inode  # a new folder swapped in, not files rewritten in place
    assert after[plot.name] == b"png" and "leank eval repo --plot x" in after["README.md"].decode()
    assert after["mask.safetensors"] == before["mask.safetensors"] and "needle-1k" in after["eval.json"].decode()

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(card, "build_card", boom)  # fails after eval.json and the plot were written (in the copy)
    with pytest.raises(RuntimeError, match="disk full"):
        card.write_model_card(folder, [{"dataset": "other", "value": 0.1}])
    assert _files(folder) == after
    assert sorted(p.name for p in tmp_path.iterdir()) == [plot.name, "repo"]  # no half-written sibling


def test_a_save_made_while_the_card_is_drawn_is_not_undone(tmp_path: Path, monkeypatch) -> None:
    """Issue #31 H3: the card update read the folder, drew for a while, then swapped its stale copy in."""
    folder = _mask_repo(tmp_path / "repo")
    newer = ChannelMask.from_scores(torch.rand(2, 2, 8, generator=torch.Generator().manual_seed(7)), ratio=0.5,
                                    align=2, base_model="org/newer")
    real_plot, drawn = card.plot_pattern, []

    def plot_while_another_process_saves(mask, path):
        if not drawn:  # the first drawing: another process saves a new mask into the folder meanwhile
            newer.save_pretrained(folder)
        drawn.append(mask.base_model)
        return real_plot(mask, path)

    monkeypatch.setattr(card, "plot_pattern", plot_while_another_process_saves)
    card.write_model_card(folder, [{"dataset": "needle-2k", "value": 0.25}])
    got = ChannelMask.from_dir(folder)
    assert torch.equal(got.keep, newer.keep) and got.base_model == "org/newer"  # the save stands
    assert drawn == ["org/model", "org/newer"]  # the card was drawn again, for the folder as it now is
    readme = (folder / "README.md").read_text()
    assert "org/newer" in readme and "needle-2k" in readme
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]


def test_an_update_of_a_folder_that_never_stops_changing_gives_up_cleanly(tmp_path: Path) -> None:
    folder = _mask_repo(tmp_path / "repo")

    def fill(tmp: Path) -> None:
        (folder / "eval.json").write_text("{}")  # someone edits the folder in place while it is read, every time
        (tmp / "README.md").write_text("x")

    with pytest.raises(atomic.FolderChanged, match="kept changing"):
        atomic.update_folder(folder, fill, lambda f: None, "mask repo", attempts=3)
    assert (folder / "mask.safetensors").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["repo"]


def test_card_update_refuses_a_folder_that_is_not_a_mask_repo(tmp_path: Path) -> None:
    from leank_infer import MaskError

    folder = _mask_repo(tmp_path / "repo")
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(MaskError, match="not a mask repo"):
        card.write_model_card(folder)
    assert (folder / "notes.txt").read_text() == "mine"


def test_write_file_replaces_at_once_and_a_failure_keeps_the_old_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "state.json"
    atomic.write_file(path, "old")
    atomic.write_file(path, b"new")
    assert path.read_text() == "new"

    def refuse(src, dst):
        raise OSError("no space")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="no space"):
        atomic.write_file(path, "newer")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_create_folder_keeps_the_first_and_a_failed_fill_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "cache" / "copy"

    def fill(text: str):
        return lambda tmp: (tmp / "weights").write_text(text)

    atomic.create_folder(target, fill("first"))
    atomic.create_folder(target, fill("second"))  # lost the race: the first copy stays, ours is dropped
    assert (target / "weights").read_text() == "first"
    assert [p.name for p in target.parent.iterdir()] == ["copy"]

    def broken(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise RuntimeError("killed")

    atomic.remove_folder(target)
    assert not target.exists() and list(target.parent.iterdir()) == []
    with pytest.raises(RuntimeError, match="killed"):
        atomic.create_folder(target, broken)
    assert list(target.parent.iterdir()) == []


# ---- issue #31: the two-rename fallback (no RENAME_EXCHANGE) and what killed writers leave -------------------
def _no_exchange(monkeypatch) -> None:
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # a file system without renameat2's exchange


def _fail_renames(monkeypatch, *which: int) -> None:
    """os.rename fails on its ``which``-th calls (1-based) from now on; the others run."""
    real, count = os.rename, [0]

    def rename(src, dst):
        count[0] += 1
        if count[0] in which:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)


def _keep(folder: Path) -> torch.Tensor:
    return ChannelMask.from_dir(folder).keep


def test_a_failed_second_rename_puts_the_old_folder_back(tmp_path: Path, monkeypatch) -> None:
    """Item 10: without the exchange, the old folder is moved aside first; if the new one cannot be moved in,
    the old one is put back in place (not left in a hidden .m.old-* folder)."""
    _no_exchange(monkeypatch)
    folder = _mask_repo(tmp_path / "m")
    before = _files(folder)
    _fail_renames(monkeypatch, 2)  # 1: old aside, 2: new in (fails), 3: old back
    with pytest.raises(OSError, match="No space left"):
        ChannelMask.full(2, 2, 8).save_pretrained(folder)
    assert _files(folder) == before and sorted(p.name for p in tmp_path.iterdir()) == ["m"]


@pytest.mark.parametrize("reader", ["load", "save"])
def test_a_writer_that_died_between_the_two_renames_is_put_right(tmp_path: Path, monkeypatch, reader) -> None:
    """M8: the old folder left in .m.old-*/x (the put-back never ran) is put back by the next open or save."""
    _no_exchange(monkeypatch)
    folder = _mask_repo(tmp_path / "m")
    before = _files(folder)
    _fail_renames(monkeypatch, 2, 3)  # the new one cannot move in, and the put-back fails too: as if killed
    with pytest.raises(OSError):
        ChannelMask.full(2, 2, 8).save_pretrained(folder)
    assert not folder.exists() and [p.name[:7] for p in tmp_path.iterdir()] == [".m.old-"]
    monkeypatch.undo()
    if reader == "load":
        ChannelMask.from_dir(folder)
        assert _files(folder) == before
    else:
        ChannelMask.full(2, 2, 8).save_pretrained(folder)
        assert bool(_keep(folder).all())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


DIE_BETWEEN_RENAMES = """
import os, sys, torch
import leank_infer.folders.atomic as atomic
from leank_infer import ChannelMask
atomic._exchange = lambda a, b: False
real = os.rename
def rename(src, dst):
    real(src, dst)
    if str(dst).endswith("/x"):
        os._exit(9)  # killed right after the old folder was moved aside
atomic.os.rename = rename
ChannelMask.full(2, 2, 8).save_pretrained(sys.argv[1])
"""


def test_a_writer_killed_between_the_renames_loses_nothing(tmp_path: Path) -> None:
    """M8 for real: a process killed between the two renames; the next reader finds the old mask in place."""
    import subprocess
    import sys

    folder = _mask_repo(tmp_path / "m")
    before = _files(folder)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", DIE_BETWEEN_RENAMES, str(folder)], env=env, timeout=120)
    assert done.returncode == 9 and not folder.exists()
    ChannelMask.from_dir(folder)  # puts the old folder back
    assert _files(folder) == before
    ChannelMask.full(2, 2, 8).save_pretrained(folder)  # and the next save removes the half-filled new one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_what_killed_saves_left_is_cleaned_but_a_live_writers_folder_is_not(tmp_path: Path) -> None:
    import fcntl

    folder = _mask_repo(tmp_path / "m")
    made = []
    for name, kind in [("m", "new"), ("m", "gone"), ("m", "old"), ("m", "new"), ("n", "new")]:
        with atomic._fresh(tmp_path, name, kind) as p:  # as leank made them (its marker inside)
            (p / "x").mkdir()
            (p / "x" / "half.safetensors").write_bytes(b"half")
        made.append(p)
    live, other = made[3], made[4]
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a writer still filling it
    try:
        ChannelMask.full(2, 2, 8).save_pretrained(folder)
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m", live.name, other.name])
    assert bool(_keep(folder).all())
