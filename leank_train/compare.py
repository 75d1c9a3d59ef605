"""How a freshly trained mask compares with a committed one: what ``leank run`` prints at its end.

A recipe's ``compare_to: hub/...`` names the committed mask folder its run is meant to reproduce. The run
reads that folder once before it trains (so a run exporting into the very same folder still compares with
what was committed) and ends with: the channels whose keep bit differs, both masks' K / V kept fractions
and zero heads, and the evaluation rows both folders hold, side by side. Nothing is evaluated here: the
rows are the ones each folder's ``eval.json`` already records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leank_infer.hub.card import EVAL_FILE
from leank_infer.mask import ChannelMask, MaskError

from .errors import RecipeError

MAX_EVAL_BYTES = 1 << 20


def read_eval_results(folder: str | Path) -> list[dict[str, Any]]:
    """The result rows of a folder's ``eval.json`` (dataset, metric, value, command); none if absent or unreadable."""
    path = Path(folder) / EVAL_FILE
    try:
        if not path.is_file() or path.stat().st_size > MAX_EVAL_BYTES:
            return []
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return []
    rows = record.get("results") if isinstance(record, dict) else None
    if not isinstance(rows, list):
        return []
    return [r for r in rows if isinstance(r, dict) and isinstance(r.get("value"), (int, float))
            and isinstance(r.get("dataset"), str) and isinstance(r.get("metric"), str)]


@dataclass(frozen=True)
class MaskSnapshot:
    """A mask folder read once: its mask and its evaluation rows, kept in memory."""

    folder: str
    mask: ChannelMask
    results: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def read(cls, folder: str | Path) -> MaskSnapshot:
        """Read ``folder``; a missing or damaged mask is a MaskError naming it."""
        return cls(str(folder), ChannelMask.from_dir(folder), read_eval_results(folder))


def read_reference(folder: str | Path) -> MaskSnapshot:
    """The recipe's ``compare_to`` folder, read before training; not a mask folder: one RecipeError naming it."""
    try:
        return MaskSnapshot.read(folder)
    except MaskError as e:
        raise RecipeError(
            f"compare_to {str(folder)!r} is not a mask folder to compare with ({e}); "
            "run from the repository root, or pass --compare_to null to skip the comparison"
        ) from None


def _side(mask: ChannelMask) -> dict[str, Any]:
    stats = mask.stats()
    return {key: stats[key] for key in ("k_kept_fraction", "v_kept_fraction", "zero_heads", "total_heads")}


def compare_masks(new: ChannelMask, reference: ChannelMask) -> dict[str, Any]:
    """Channels whose keep bit differs (count, fraction of all channels) and each mask's kept fractions.

    ``differing_channels`` is None when the shapes differ (masks of different models do not line up).
    """
    total = new.keep.numel()
    differing = int((new.keep.bool() != reference.keep.bool()).sum()) if new.keep.shape == reference.keep.shape \
        else None
    return {
        "differing_channels": differing,
        "total_channels": total,
        "differing_fraction": None if differing is None else differing / total,
        "new": _side(new),
        "reference": _side(reference),
    }


def eval_side_by_side(
    new_rows: list[dict[str, Any]], reference_rows: list[dict[str, Any]]
) -> list[tuple[str, str, float, float]]:
    """(dataset, metric, new value, reference value) for every row both measured, in the reference's order."""
    new = {(r["dataset"], r["metric"]): float(r["value"]) for r in new_rows}
    return [(r["dataset"], r["metric"], new[(r["dataset"], r["metric"])], float(r["value"]))
            for r in reference_rows if (r["dataset"], r["metric"]) in new]


def _heads(side: dict[str, Any]) -> str:
    return f"{side['zero_heads']} of {side['total_heads']}"


def _command(rows: list[dict[str, Any]]) -> str | None:
    return next((r["command"] for r in rows if isinstance(r.get("command"), str)), None)


def format_comparison(new: MaskSnapshot, reference: MaskSnapshot) -> str:
    """The lines ``leank run`` prints: differing channels, kept fractions, zero heads, evaluation side by side."""
    c = compare_masks(new.mask, reference.mask)
    a, b = c["new"], c["reference"]
    if c["differing_channels"] is None:
        differ = f"masks of different shapes ({tuple(new.mask.keep.shape)} vs {tuple(reference.mask.keep.shape)})"
    else:
        differ = f"{c['differing_channels']} of {c['total_channels']} ({c['differing_fraction']:.1%})"
    lines = [
        f"[leank run] this run ({new.folder}) vs the committed mask ({reference.folder})",
        f"  channels that differ {differ}",
        f"  {'':20} {'this run':>12} {'committed':>12}",
        f"  {'k_kept_fraction':20} {a['k_kept_fraction']:>12.3f} {b['k_kept_fraction']:>12.3f}",
        f"  {'v_kept_fraction':20} {a['v_kept_fraction']:>12.3f} {b['v_kept_fraction']:>12.3f}",
        f"  {'zero heads':20} {_heads(a):>12} {_heads(b):>12}",
    ]
    rows = eval_side_by_side(new.results, reference.results)
    if not rows:
        why = ("this run recorded no evaluation" if not new.results
               else f"{reference.folder} has no {EVAL_FILE}" if not reference.results
               else "no row measured by both")
        lines.append(f"  evaluation           nothing to set side by side ({why})")
        return "\n".join(lines)
    lines += ["  evaluation", "  | dataset | metric | this run | committed |", "  |---|---|---|---|"]
    lines += [f"  | {d} | {m} | {x:.4g} | {y:.4g} |" for d, m, x, y in rows]
    new_cmd, ref_cmd = _command(new.results), _command(reference.results)
    if new_cmd and ref_cmd and new_cmd.replace(new.folder, "MASK") != ref_cmd.replace(reference.folder, "MASK"):
        lines.append("  (different evaluation settings: compare with care)")
    lines += [f"  this run:  `{new_cmd}`", f"  committed: `{ref_cmd}`"]
    return "\n".join(lines)
