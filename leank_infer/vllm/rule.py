"""The LeanK position rule as the vLLM backend uses it: one function, nothing else.

Merge note: the HF decode core keeps this rule in ``leank_infer.cache.LeanKLayer`` (``finish_prefill``
and ``_roll``); a refactor in flight moves it into one rule module. When that lands, this
function becomes a call into it; the backend calls only :func:`recent_start`.
"""

from __future__ import annotations


def recent_start(prefill_len: int, length: int, recent_size: int, accumu_size: int) -> int:
    """Where the full-channel recent part begins for the next key appended after ``length`` cached tokens.

    LEANK.md, "Exact boundaries": after a prefill of ``prefill_len`` tokens the recent part starts at
    ``max(0, prefill_len - recent_size)``; before each later token is appended, while the full part
    ``[R, length)`` holds more than ``recent_size + accumu_size`` tokens, R advances by ``accumu_size``.
    Keys in ``[sink, R)`` are middle keys (kept channels only), keys in ``[0, sink)`` and
    ``[R, length]`` use every channel. Closed form of that loop, so a decode step needs no history.
    """
    r = max(0, prefill_len - recent_size)
    excess = length - r - (recent_size + accumu_size)
    if excess > 0:
        r += -(-excess // accumu_size) * accumu_size
    return r
