"""The LeanK rule: which keys a query scores with all channels, which with the kept ones only.

This module is the only place the rule is computed. The training reference
(:mod:`leank_infer.decode.masked_attention`, hence the student), the decode masks of the cache
(:mod:`leank_infer.decode.layout`) and every decode backend get their regions from :func:`key_regions`;
the scale, the soft-cap and the GQA reshape they share live here too.

The rule (docs/rule.md, "Exact boundaries"), in padded coordinates: a row whose first real token is
at ``start`` (left padding), and a query at position ``p`` whose full recent part begins at
``recent_from``, see

- padding ``[0, start)`` and the future ``(p, ...)``: not at all,
- sink ``[start, start + sink)`` and recent ``[recent_from, p]``: all channels,
- middle ``[start + sink, recent_from)``: only the channels the mask keeps; a KV head that keeps
  none skips its middle keys entirely (the cache stores no V for them).

Training uses ``recent_from = p - recent_size`` for every query (:func:`training_recent_from`). Decoding
places it by the position alone (:func:`positional_recent_from`); the rules (:data:`RULES`, each described
once in :data:`RULE_DESCRIPTIONS`) differ in whether the prompt's own queries are pruned.
"""

from __future__ import annotations

import torch


def key_regions(
    key_pos: torch.Tensor,
    query_pos: torch.Tensor,
    row_start: torch.Tensor,
    sink_size: int,
    recent_from: torch.Tensor | int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible, middle) bool masks of keys for queries, broadcast over the inputs' shapes.

    ``key_pos`` / ``query_pos`` / ``row_start`` / ``recent_from`` are integer positions in
    padded coordinates, already shaped to broadcast (e.g. keys ``[1, 1, K]``, queries
    ``[B, Q, 1]``, starts ``[B, 1, 1]``). ``visible``: the key is neither padding nor in the
    future. ``middle``: a visible key scored with the kept channels only (the rest of
    ``visible`` uses all channels). Zero-channel heads drop ``middle`` keys: see :func:`attended`.
    """
    visible = (key_pos >= row_start) & (key_pos <= query_pos)
    middle = (key_pos >= row_start + sink_size) & (key_pos < recent_from)
    return visible, middle & visible


def attended(visible: torch.Tensor, middle: torch.Tensor, zero_heads: torch.Tensor) -> torch.Tensor:
    """Keys a head attends at all: ``visible`` minus the middle of heads that keep no channel.

    ``zero_heads`` is a bool tensor shaped to broadcast against ``middle`` on its head axis.
    """
    return visible & ~(middle & zero_heads)


def training_recent_from(query_pos: torch.Tensor, recent_size: int) -> torch.Tensor:
    """First full recent key of a query at ``query_pos`` in training (and the first decode step)."""
    return query_pos - recent_size


def positional_recent_from(query_pos: torch.Tensor | int, recent_size: int, accumu_size: int) -> torch.Tensor | int:
    """First full recent key of a query at ``query_pos`` under the positional rule (vLLM's, and the HF
    path's ``rule="positional"``): ``recent_size`` keys back, rounded down to a multiple of
    ``accumu_size``. It depends on the position alone, so chunked, unchunked, cached and recomputed
    prefills see the same keys; a query sees between ``recent_size + 1`` and ``recent_size +
    accumu_size`` recent keys with every channel, and the window moves ``accumu_size`` tokens at a time."""
    if isinstance(query_pos, int):
        return (query_pos - recent_size) // accumu_size * accumu_size
    return torch.div(query_pos - recent_size, accumu_size, rounding_mode="floor") * accumu_size


def row_recent_from(
    query_pos: torch.Tensor, row_start: torch.Tensor, recent_size: int, accumu_size: int
) -> torch.Tensor:
    """:func:`positional_recent_from` in padded coordinates: a row whose first real token is at ``row_start``
    (left padding) counts positions from there. Inputs broadcast (e.g. queries ``[B, Q, 1]``, starts ``[B, 1, 1]``)."""
    return row_start + positional_recent_from(query_pos - row_start, recent_size, accumu_size)


def positional_compressible(length: int, row_starts: torch.Tensor, recent_size: int, accumu_size: int) -> int:
    """Under the positional rule, keys below this index are middle keys for every row's query at ``length``
    (padded coordinates) and for every later one (``recent_from`` never decreases with the position): what a
    cache may store with the kept channels only before queries from ``length`` on join it."""
    return int(row_recent_from(torch.as_tensor(length), row_starts, recent_size, accumu_size).min())


DENSE_PROMPT = "dense-prompt"
POSITIONAL = "positional"

#: Each rule's one-line description, the one place it is written: the ``--rule`` / ``--rules`` /
#: ``--student_rule`` help, the docstrings of the API reference and docs/rule.md quote it, and
#: tests/test_rule.py holds every one of them to this text.
RULE_DESCRIPTIONS: dict[str, str] = {
    DENSE_PROMPT: "the prompt attends with every channel, each generated token by its position",
    POSITIONAL: "every query, the prompt's too, by its position alone",
}
#: The rules, the default first. Both are what vLLM's chunked prefill and prefix cache can reproduce: each
#: query's keys depend on its position and, under ``"dense-prompt"``, on the prompt's length, never on how
#: the prompt was scheduled.
RULES: tuple[str, ...] = tuple(RULE_DESCRIPTIONS)
DEFAULT_RULE = DENSE_PROMPT

#: Rule names that are no longer served, each with its replacement and why (docs/rule.md, "The rules").
RETIRED_RULES: dict[str, tuple[str, str]] = {
    "dense-prefill": (
        DENSE_PROMPT,
        "its decode schedule was anchored at the prompt's end, which vLLM's chunked prefill cannot reproduce, "
        "and it gave the same answers as dense-prompt on the measured probes at no speed advantage",
    ),
}


class RuleError(ValueError):
    """A rule name that is not one of :data:`RULES` (a retired one says which rule replaces it)."""


def check_rule(rule: str) -> str:
    """``rule`` if it is one of :data:`RULES`, else a :class:`RuleError` (a retired name: its replacement, and why)."""
    if rule in RETIRED_RULES:
        new, why = RETIRED_RULES[rule]
        raise RuleError(f"rule {rule!r} is retired: use {new!r} ({RULE_DESCRIPTIONS[new]}); {why}")
    if rule not in RULES:
        raise RuleError(f"rule must be one of {', '.join(repr(r) for r in RULES)}, got {rule!r}")
    return rule


def rules_help() -> str:
    """The rules and their descriptions as one sentence, for help texts (the default marked)."""
    return "; ".join(f"{name}{' (the default)' if name == DEFAULT_RULE else ''}: {text}"
                     for name, text in RULE_DESCRIPTIONS.items())


def default_scale(head_dim: int, scaling: float | None = None) -> float:
    """The logit scale: the model's, else ``1/sqrt(head_dim)``; LeanK never renormalises it."""
    return float(scaling) if scaling is not None else head_dim**-0.5


def apply_softcap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's logit soft-capping after the scale, ``cap * tanh(logit / cap)`` (None: unchanged);
    in place unless autograd needs the scores (training)."""
    if softcap is None:
        return scores
    if scores.requires_grad:
        return torch.tanh(scores / softcap) * softcap
    return scores.div_(softcap).tanh_().mul_(softcap)


def gqa_view(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, Hq, Q, D]`` -> ``[B, Hkv, G, Q, D]``: query head h uses KV head ``h // G`` (transformers' GQA)."""
    b, hq, q_len, d = query.shape
    if hq % num_kv_heads:
        raise ValueError(f"{hq} query heads are not a multiple of {num_kv_heads} KV heads")
    return query.reshape(b, num_kv_heads, hq // num_kv_heads, q_len, d)
