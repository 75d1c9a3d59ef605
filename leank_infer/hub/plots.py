"""The result figures of the docs and the mask cards, each drawn from what one command measured.

matplotlib is imported lazily (it comes with the ``train`` extra). A figure carries no command in its pixels (a
long command is unreadable at page size): the card's caption under it shows the command, and the PNG keeps it
in its metadata (``Description``), so a figure copied elsewhere still says what drew it.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MARKERS = {"full": "o", "leank": "s", "random": "v", "think": "^"}


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install 'leank[train]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path, command: str | None, title: str | None = None) -> Path:
    """Write ``fig`` with ``title`` above (wrapped to its width); ``command``, the one that made it, goes into the
    PNG's ``Description`` metadata, not into the picture."""
    width, _ = fig.get_size_inches()
    if title:
        lines = textwrap.wrap(title, max(20, int(width * 11)))  # 11 pt: about 11 characters per inch
        fig.suptitle("\n".join(lines), fontsize=11)  # tight_layout makes room for it
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Description": command} if command else None)
    _pyplot().close(fig)
    return out


def _stderr(p: float, n: int) -> float:
    """Binomial standard error of an accuracy ``p`` measured on ``n`` probes."""
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else 0.0


def plot_accuracy(results: dict[str, Any], path: str | Path, command: str | None = None) -> Path:
    """Retrieval accuracy against context length, one line per method (``leank eval`` results)."""
    plt = _pyplot()
    n = int(results.get("samples_per_length", 0))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method, by_length in results["accuracy"].items():
        xs = sorted(int(k) for k in by_length)
        ys = [by_length[x] if x in by_length else by_length[str(x)] for x in xs]
        ax.errorbar(xs, ys, yerr=[_stderr(y, n) for y in ys], marker=MARKERS.get(method, "."), capsize=3,
                    label=method)
    ax.set_xscale("log", base=2)
    ax.set_xticks(results["lengths"], [str(x) for x in results["lengths"]])
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel(f"retrieval accuracy ({n} probes per length, +/- 1 s.e.)")
    ax.set_title("Needle retrieval on unseen prompts: full model vs LeanK vs baselines")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path, command)


def plot_ratio_sweep(sweep: dict[str, Any], path: str | Path, command: str | None = None) -> Path:
    """Accuracy (per length) and KV bytes per pruned token against the pruning ratio (``leank eval`` sweeps)."""
    plt = _pyplot()
    rows = sorted(sweep["masks"], key=lambda r: r["ratio"])
    ratios = [r["ratio"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, length in enumerate(sweep["lengths"]):
        line = ax1.plot(ratios, [r["accuracy"][length] for r in rows], marker="s", label=f"LeanK, {length} tok")
        full = sweep["full"].get(length)
        if full is not None:
            ax1.axhline(full, color=line[0].get_color(), linestyle="--", linewidth=1,
                        label=f"full model, {length} tok" if i == 0 else None)
    ax1.set_xlabel("fraction of K channels pruned (ratio)")
    score = "headline score" if "tasks" in sweep else "retrieval accuracy"  # the suite: its headline score
    probes = f"{sweep['samples_per_length']} probes per {'task' if 'tasks' in sweep else 'length'}"
    long = len(probes) > 30  # several runs, probes per length differ: too long for the axis, under the title
    ax1.set_ylabel(score if long else f"{score} ({probes})")
    ax1.set_ylim(-0.05, 1.05)
    ax1.set_title("Accuracy vs ratio (dashed: full model)" + (f"\n{probes}" if long else ""),
                  fontsize=10 if long else None)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    dense = rows[0]["bytes_per_token"]["dense"]
    ax2.plot(ratios, [r["bytes_per_token"]["leank"] for r in rows], marker="s", label="LeanK (K kept + V of live heads)")
    ax2.axhline(dense, color="k", linestyle="--", linewidth=1, label="dense")
    for r in rows:
        ax2.annotate(f"{r['zero_heads']} zero heads", (r["ratio"], r["bytes_per_token"]["leank"]),
                     textcoords="offset points", xytext=(4, 6), fontsize=7)
    ax2.set_ylim(0, dense * 1.1)
    ax2.set_xlabel("fraction of K channels pruned (ratio)")
    ax2.set_ylabel(f"KV bytes per pruned token ({rows[0]['bytes_per_token']['dtype']})")
    ax2.set_title("Cache bytes per token vs ratio")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    return _save(fig, path, command)


def plot_decode_time(rows: Sequence[dict[str, Any]], path: str | Path, command: str | None = None) -> Path:
    """Median decode-step time against context length, dense vs LeanK, one pair of lines per batch size."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for batch in sorted({r["batch"] for r in rows}):
        sel = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["context"])
        xs = [r["context"] for r in sel]
        dense = ax.plot(xs, [r["dense_ms"] for r in sel], marker="o", linestyle="--", label=f"dense, batch {batch}")
        ax.plot(xs, [r["leank_ms"] for r in sel], marker="s", color=dense[0].get_color(), label=f"LeanK, batch {batch}")
    contexts = sorted({r["context"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step (ms, median)")
    ax.set_title("Decode time vs context length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path, command)


def plot_pareto(results: dict[str, Any], path: str | Path, command: str | None = None) -> Path:
    """KV bytes per token against the headline score, one point per method and one panel per length (the memory
    levers side by side: channels, bits, both); the methods on the upper-left frontier are joined."""
    plt = _pyplot()
    lengths = results["lengths"]
    heads = results.get("headline", {})
    per_token = results["bytes_per_token"]
    fig, axes = plt.subplots(1, len(lengths), figsize=(max(6.4, 4.6 * len(lengths)), 5.0), squeeze=False)
    for ax, n in zip(axes[0], lengths, strict=True):
        h = heads.get(n, heads.get(str(n), {}))
        pts = [(per_token[m], h[m]["score"], h[m]["se"], m) for m in results["methods"] if m in h]
        for x, y, se, m in pts:
            ax.errorbar([x], [y], yerr=[se], marker=MARKERS.get(m.split("-")[0], "o"), capsize=3, linestyle="",
                        label=m)
        front, best = [], -1.0
        for x, y, _, _ in sorted(pts):
            if y > best:
                front.append((x, y))
                best = y
        if len(front) > 1:
            ax.plot(*zip(*front, strict=True), color="grey", linewidth=1, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(lambda x, _: f"{x:,.0f}")  # bytes, not powers of two
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel(f"KV bytes per token at {results.get('bytes_at', 8192):,} tokens (bf16)")
        ax.set_ylabel("headline score (+/- 1 s.e.)")
        ax.set_title(f"{n} tokens")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    return _save(fig, path, command, "Channels (LeanK) x bits (kv_quant, QuantizedCache): bytes vs retrieval")
