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
