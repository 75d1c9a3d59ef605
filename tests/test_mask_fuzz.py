"""Fuzzing the mask format: random shapes, ratios, aligns and damaged files never crash obscurely."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leank_infer import ChannelMask, MaskError
from leank_infer.mask import CONFIG_FILE, MASK_FILE

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(
    layers=st.integers(1, 4),
    heads=st.integers(1, 4),
    dim=st.sampled_from([1, 2, 8, 12, 16, 64]),
    ratio=st.one_of(st.floats(-1, 2), st.just(float("nan")), st.sampled_from([0.0, 0.5, 0.7, 0.99])),
    align=st.integers(-2, 80),
    seed=st.integers(0, 2**16),
)
def test_from_scores_never_crashes(layers, heads, dim, ratio, align, seed):
    scores = torch.rand(layers, heads, dim, generator=torch.Generator().manual_seed(seed))
    try:
        mask = ChannelMask.from_scores(scores, ratio, align)
    except MaskError:
        assert not (0 <= ratio < 1) or align <= 0 or dim % align != 0
        return
    counts = mask.kept_counts
    assert (counts % align == 0).all() and (counts <= dim).all()
    assert mask.keep.shape == scores.shape


def _damage(data: bytes, how: int, where: float) -> bytes:
    i = int(where * max(1, len(data) - 1))
    if how == 0:
        return data[:i]  # truncated
    if how == 1:
        return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]  # one byte flipped
    return data[:i] + b"\x00" * 16 + data[i:]  # bytes inserted


@FUZZ
@given(target=st.sampled_from([MASK_FILE, CONFIG_FILE]), how=st.integers(0, 2), where=st.floats(0, 1))
def test_damaged_files_load_or_fail_cleanly(target, how, where):
    mask = ChannelMask.from_scores(torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(3)), 0.5, 4)
    with tempfile.TemporaryDirectory() as tmp:
        mask.save_pretrained(tmp)
        path = Path(tmp) / target
        path.write_bytes(_damage(path.read_bytes(), how, where))
        try:
            back = ChannelMask.from_pretrained(tmp)
        except MaskError:
            return
        # a damage that still loads must still give a well-formed mask of the recorded shape
        assert back.keep.shape == (back.num_layers, back.num_kv_heads, back.head_dim)
        assert back.keep.dtype == torch.bool


# ---- config.json structure and sizes (issue #21) --------------------------------------------------------------
JSON_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.sampled_from([0, 1, -1, 2**31, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
)
JSON = st.recursive(JSON_LEAF, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=12)
KEYS = ["format_version", "num_layers", "num_kv_heads", "head_dim", "sink_size", "recent_size", "accumu_size",
        "ratio", "align", "base_model", "base_revision", "loader", "recipe", "extra", "adapter", "adapter_revision",
        "dense_layers", "config_overrides"]


def _nest(value, depth: int):
    for _ in range(depth):
        value = [value]
    return value


@FUZZ
@given(
    changes=st.dictionaries(st.sampled_from([*KEYS, "unknown_key"]), JSON, max_size=4),
    dropped=st.lists(st.sampled_from(KEYS), max_size=2),
    depth=st.sampled_from([0, 5, 31, 33, 200, 5000]),
    pad=st.sampled_from([0, 1000, (1 << 20) - 2000, (1 << 20) + 1]),
    top=st.sampled_from(["object", "list", "string", "number"]),
)
def test_config_json_structure_and_size_load_or_fail_cleanly(changes, dropped, depth, pad, top):
    import json

    from leank_infer.mask import MAX_CONFIG_BYTES

    mask = ChannelMask.from_scores(torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(3)), 0.5, 4)
    with tempfile.TemporaryDirectory() as tmp:
        folder = mask.save_pretrained(Path(tmp) / "m")
        cfg = json.loads((folder / CONFIG_FILE).read_text())
        cfg.update(changes)
        for key in dropped:
            cfg.pop(key, None)
        if depth:
            cfg["extra"] = {"deep": _nest(1, depth)}
        if pad:
            cfg["recipe"] = "x" * pad
        doc = {"object": cfg, "list": [cfg], "string": "cfg", "number": 1}[top]
        try:
            text = json.dumps(doc)
        except (RecursionError, ValueError):  # json itself cannot write it: write the nesting by hand
            text = "[" * depth + "]" * depth
        (folder / CONFIG_FILE).write_text(text)
        try:
            back = ChannelMask.from_dir(folder)
        except MaskError as e:
            assert len(str(e)) < 2000  # one readable line, not a dump of the file
            return
        # what loads is a well-formed mask that every method handles and that writes back the same
        assert top == "object" and depth <= 31 and len(text.encode()) <= MAX_CONFIG_BYTES
        assert back.head_dim >= 1 and 0 <= back.sink_size < 2**31 and isinstance(back.extra, dict)
        repr(back)
        back.kv_cache_bytes(10_000)
        again = ChannelMask.from_dir(back.save_pretrained(Path(tmp) / "again"))
        assert again.to_config() == back.to_config()


# ---- repo ids and revisions never leave the Hub cache (issue #21) ---------------------------------------------------
NAMES = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="ab./-_~\\\x00 ", max_size=30),
    st.sampled_from(["", ".", "./", "..", "../..", "/", "org/name", "a" * 97, "a" * 500, "org/name/x", "~/x",
                     "refs/pr/1", "a" * 40, "main", "v1.0", "../../../../etc/passwd"]),
)


@FUZZ
@given(repo_id=NAMES, revision=st.one_of(st.none(), NAMES))
def test_repo_ids_and_revisions_fail_cleanly_offline(repo_id, revision):
    import os
    from unittest import mock

    from leank_infer.folders.names import revision_problem

    if revision is not None and revision_problem(revision) is None:
        # an accepted revision names a ref inside refs/ and a snapshot inside snapshots/
        for folder in ("refs", "snapshots"):
            assert os.path.normpath(os.path.join(folder, revision)).startswith(folder + os.sep)
        assert len(revision) <= 255 and "\x00" not in revision
    with tempfile.TemporaryDirectory() as tmp:
        cache, work = Path(tmp) / "cache", Path(tmp) / "work"
        work.mkdir()
        cwd = os.getcwd()
        os.chdir(work)
        try:
            with mock.patch.dict(os.environ, {"HF_HUB_OFFLINE": "1"}):
                try:
                    ChannelMask.from_pretrained(repo_id, revision=revision, cache_dir=cache)
                except MaskError as e:
                    assert len(str(e)) < 1500
                else:
                    raise AssertionError(f"{repo_id!r} at {revision!r} loaded from an empty cache")
        finally:
            os.chdir(cwd)
        assert list(work.iterdir()) == []  # nothing written in the current folder
        written = [p for p in Path(tmp).rglob("*") if p.is_file()]
        assert written == [], written
