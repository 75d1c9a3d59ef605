"""Results as people read them: markdown tables (suite, needles, ratio sweep) and model-card rows."""

from __future__ import annotations

from typing import Any

from .stats import summarize


def card_results(results: dict[str, Any], command: str) -> list[dict[str, Any]]:
    """Evaluation results in the shape ``leank_infer.hub.card.build_card`` puts in the model index.

    Suite results give one row per (task, length, method), whose dataset name says the task and length and
    whose metric name says the method (also as ``dataset_args`` / ``metric_config``; the Hub groups a
    model index by dataset type and config, so the config names task and length), plus one headline row
    per (length, method); the Wilson interval and the paired counts against the full model travel in
    ``metric_args`` and in the card table's cell text.
    """
    rows = []
    if "tasks" in results:
        for task, by_method in results["tasks"].items():
            for method, by_length in by_method.items():
                for length, c in sorted(by_length.items(), key=lambda kv: int(kv[0])):
                    args = {"method": method, "correct": c["correct"], "n": c["n"], "wilson95": c["wilson95"]}
                    if "paired" in c:
                        args["paired_vs_full"] = c["paired"]
                    rows.append({"dataset": f"leank-ruler {task}, {length} tokens", "dataset_type": "leank-ruler",
                                 "dataset_config": f"{task}-{length}", "dataset_args": {"task": task, "length": int(length)},
                                 "metric": f"accuracy ({method})", "metric_config": method, "metric_args": args,
                                 "value": c["accuracy"], "text": _cell_text(c), "command": command})
        for length, h in sorted(results.get("headline", {}).items(), key=lambda kv: int(kv[0])):
            for method in results["methods"]:
                if method not in h:
                    continue
                args = {"method": method, "se": h[method]["se"], "tasks": h["tasks"]}
                if "paired" in h[method]:
                    args["paired_vs_full"] = h[method]["paired"]
                rows.append({"dataset": f"leank-ruler headline (tasks the full model passes), {length} tokens",
                             "dataset_type": "leank-ruler", "dataset_config": f"headline-{length}",
                             "dataset_args": {"task": "headline", "length": int(length), "tasks": h["tasks"]},
                             "metric": f"accuracy ({method})", "metric_config": method, "metric_args": args,
                             "value": h[method]["score"], "text": _headline_text(h[method]), "command": command})
    else:
        for method, by_length in results["accuracy"].items():
            for length, value in sorted(by_length.items()):
                rows.append({"dataset": f"unseen needles, {length} tokens", "dataset_config": f"needles-{length}",
                             "metric": f"accuracy ({method})", "value": value, "command": command})
    if "next_token_kl" in results:
        rows.append({"dataset": "held-out stdlib docstrings, 1024 + 32 tokens", "dataset_config": "next-token-kl",
                     "metric": "next-token KL (nats)",
                     "metric_type": "kl_divergence", "value": results["next_token_kl"], "command": command})
    return rows


def renamed(results: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """The suite results of some methods under other names, summarized afresh on the same probes.

    One pass can answer with several masks and their baselines (``leank-r80``, ``random-r80``, ...); each
    mask's card wants the full model, its mask and its baselines as ``full``, ``leank``, ``random``,
    ``think``. ``names`` maps old method names to new ones; the paired counts are against ``full``.
    Results of the older needle probes (no ``tasks``) are renamed without a suite summary.
    """
    methods = [new for old, new in names.items() if old in results["methods"]]
    answers = [{**{k: v for k, v in r.items() if k not in results["methods"] and k != "correct"},
                **{new: r[old] for old, new in names.items() if old in r},
                "correct": {new: r["correct"][old] for old, new in names.items() if old in r["correct"]}}
               for r in results["answers"]]
    lengths = [int(n) for n in results["lengths"]]
    return {"methods": methods, "lengths": lengths, "answers": answers,
            **(summarize(answers, methods, lengths, list(results["tasks"])) if "tasks" in results else {})}


def _cell_text(c: dict[str, Any]) -> str:
    """``k/n acc [lo, hi]``, and for a method against the full model ``-only_full/+only_method``."""
    lo, hi = c["wilson95"]
    text = f"{c['correct']}/{c['n']} {c['accuracy']:.2f} [{lo:.2f}, {hi:.2f}]"
    if "paired" in c:
        text += f" -{c['paired']['only_full']}/+{c['paired']['only_method']}"
    return text


def _headline_text(h: dict[str, Any]) -> str:
    text = f"{h['score']:.3f} +/- {h['se']:.3f}"
    if "paired" in h:
        text += f" -{h['paired']['only_full']}/+{h['paired']['only_method']} (p={h['paired']['mcnemar_p']:.2g})"
    return text


def format_table(results: dict[str, Any]) -> str:
    """Markdown: per task and method a cell per length (``k/n acc [Wilson 95%] -only_full/+only_method``),
    then the headline per method with the tasks it covers; the needle kinds: accuracy per method and length."""
    if "tasks" in results:
        return _format_suite(results)
    acc = results["accuracy"]
    lengths = results["lengths"]
    head = "| method | " + " | ".join(f"{n} tok" for n in lengths) + " |"
    sep = "|---|" + "---|" * len(lengths)
    rows = [f"| {m} | " + " | ".join(f"{acc[m].get(n, float('nan')):.2f}" for n in lengths) + " |" for m in acc]
    lines = [head, sep, *rows]
    if "next_token_kl" in results:
        lines.append(f"\nmean next-token KL(full || LeanK): {results['next_token_kl']:.4f} nats")
    return "\n".join(lines)


def _at(by_length: dict[Any, Any], n: int) -> Any:
    """The entry of length ``n`` whether keys are ints (fresh results) or strings (read back from JSON)."""
    return by_length.get(n, by_length.get(str(n)))


def _format_suite(results: dict[str, Any]) -> str:
    lengths = results["lengths"]
    cols = " | ".join(f"{n} tok" for n in lengths)
    lines = [f"| task | method | {cols} |", "|---|---|" + "---|" * len(lengths)]
    for task, by_method in results["tasks"].items():
        for method, by_length in by_method.items():
            cells = [_cell_text(c) if (c := _at(by_length, n)) else "" for n in lengths]
            lines.append(f"| {task} | {method} | " + " | ".join(cells) + " |")
    heads = results.get("headline", {})
    for method in results["methods"]:
        cells = [_headline_text(h[method]) if (h := _at(heads, n)) and method in h else "n/a" for n in lengths]
        lines.append(f"| **headline** | {method} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("cells: correct/probes, accuracy, [Wilson 95% interval], -probes only the full model got right"
                 "/+probes only this method got right; headline: mean over the tasks where the full model scores"
                 " >= 80% at that length, +/- its standard error, paired counts summed, exact McNemar p")
    for n in lengths:
        if h := _at(heads, n):
            lines.append(f"headline tasks at {n} tokens ({len(h['tasks'])}): {', '.join(h['tasks'])}"
                         f"; probes per task for s.e. <= 0.03: {h['probes_for_se_0.03']}")
    if "next_token_kl" in results:
        lines.append(f"\nmean next-token KL(full || LeanK): {results['next_token_kl']:.4f} nats")
    return "\n".join(lines)


def format_sweep(sweep: dict[str, Any]) -> str:
    lengths = sweep["lengths"]
    head = "| mask | ratio | K kept | V kept | zero heads | KV bytes/token (bf16) | " + " | ".join(
        f"{n} tok" for n in lengths) + " |"
    lines = [head, "|---" * (6 + len(lengths)) + "|"]
    dense = sweep["masks"][0]["bytes_per_token"]["dense"]
    lines.append("| full model | 0 | 100% | 100% | 0 | " + f"{dense:,} | "
                 + " | ".join(f"{sweep['full'][n]:.2f}" for n in lengths) + " |")
    for r in sorted(sweep["masks"], key=lambda r: r["ratio"]):
        b = r["bytes_per_token"]
        lines.append(f"| {r['mask']} | {r['ratio']:g} | {r['k_kept']:.1%} | {r['v_kept']:.1%} | {r['zero_heads']} | "
                     f"{b['leank']:,} ({b['leank_over_dense']:.2f}x) | " + " | ".join(f"{r['accuracy'][n]:.2f}" for n in lengths)
                     + " |")
    return "\n".join(lines)
