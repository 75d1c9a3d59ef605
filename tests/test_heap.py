"""The positional student's step keeps host memory bounded (leank_train.heap, benchmarks/student_heap.py)."""

from __future__ import annotations

import pytest
from conftest import load_benchmark, tiny_model

from leank_train.heap import uses_glibc

glibc = pytest.mark.skipif(not uses_glibc(), reason="glibc's allocator only")


@glibc
@pytest.mark.slow
def test_a_fixed_threshold_keeps_the_student_step_from_growing_the_heap():
    """The same step in two fresh processes: with glibc's rising threshold the resident memory grows by
    several times what the fixed threshold lets it."""
    bench = load_benchmark("student_heap")
    default = bench.measure(2048, embedded=False, fixed=False, layers=3)
    fixed = bench.measure(2048, embedded=False, fixed=True, layers=3)
    assert fixed["threshold_set"] and not default["threshold_set"]
    assert fixed["growth_bytes"] * 3 < default["growth_bytes"], (default, fixed)


@glibc
def test_the_threshold_stays_the_users_when_they_set_it(monkeypatch):
    from leank_train.heap import fix_mmap_threshold

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert fix_mmap_threshold() is False


@glibc
@pytest.mark.parametrize("garbage", ["lots", "", "4M", "-1"])
def test_a_threshold_glibc_cannot_read_is_named_and_replaced(monkeypatch, garbage):
    """glibc ignores a value it cannot read as a number, which left its rising threshold (the heap fix off)."""
    from leank_train import heap

    set_to = []
    monkeypatch.setattr(heap.ctypes, "CDLL", lambda _: type("C", (), {"mallopt": lambda self, p, n: set_to.append((p, n)) or 1})())
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", garbage)
    with pytest.warns(UserWarning, match=f"MALLOC_MMAP_THRESHOLD_={garbage!r} is not a number of bytes"):
        assert heap.fix_mmap_threshold() is True
    assert set_to == [(heap.M_MMAP_THRESHOLD, heap.THRESHOLD)]


def test_the_positional_student_fixes_the_threshold_and_the_dense_one_leaves_it(monkeypatch):
    from leank_train.distill import module as distill

    calls = []
    monkeypatch.setattr(distill, "fix_mmap_threshold", lambda: calls.append(1) or True)
    distill.LeanKDistillation.for_model(tiny_model(), stage=1, student_rule="dense-prompt")
    assert calls == []
    distill.LeanKDistillation.for_model(tiny_model(), stage=1, student_rule="positional")
    assert calls == [1]
