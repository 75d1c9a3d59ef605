"""mkdocs hooks: the docs pages and tables that are made from the repository at build time.

- one page per mask folder in ``hub/`` (``masks/<folder>/``): its model card (``hub/<folder>/README.md``,
  written by ``leank_infer/hub/card.py`` from the folder's files and ``eval.json``), its figures, and the
  runs behind it: each command recorded in ``eval.json`` with the date git last changed its results;
- markers in the hand-written pages, replaced by generated markdown:
  ``<!-- leank:masks-table -->`` (the headline table of the published masks),
  ``<!-- leank:recipes-table -->`` (which recipe gives which mask, its budget and score),
  ``<!-- leank:suite-table -->`` (the evaluation suite's rows of every evaluated mask, per task),
  ``<!-- leank:which-mask -->`` (the one recommendation: which mask for which use, length and engine),
  ``<!-- leank:cli -->`` (the ``leank`` command reference, rendered from the real parsers), and
  ``<!-- leank:NAME -->`` for a benchmark's measured table, ``docs/results/NAME.json`` (written by the
  benchmark's ``--save``, ``benchmarks/results.py``), shown with its command and date.

The same functions print the README's mask table: ``python docs/hooks/leank_docs.py masks-table``
(``tests/test_docs.py`` checks that README.md holds exactly that output).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HUB = ROOT / "hub"
RECIPES = ROOT / "recipes"
MARKER = re.compile(r"<!-- leank:([\w-]+) -->")
RESULTS = ROOT / "docs" / "results"
STATS_COMMAND = (
    "python -c \"import torch; from leank_infer import ChannelMask; "
    "print(ChannelMask.from_pretrained('{folder}').stats(dtype=torch.bfloat16))\""
)


# ---- the repository's facts ------------------------------------------------------------------------------
def mask_folders() -> list[Path]:
    """The published mask folders: ``hub/*`` holding a ``config.json``, sorted by name."""
    return sorted(p for p in HUB.iterdir() if (p / "config.json").is_file())


def git_date(path: Path, needle: str | None = None) -> str | None:
    """The date (YYYY-MM-DD) of the last commit that changed ``path`` (with ``needle``: that changed how often
    ``needle`` occurs in it, i.e. wrote or rewrote that run's rows); None outside a git checkout."""
    args = ["git", "-C", str(ROOT), "log", "-1", "--format=%cs"]
    args += [f"-S{needle}"] if needle else []
    try:
        out = subprocess.run([*args, "--", str(path.relative_to(ROOT))], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def eval_record(folder: Path) -> dict[str, Any]:
    path = folder / "eval.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def headline(folder: Path) -> dict[str, Any] | None:
    """The mask's headline at its shortest evaluated length, from ``eval.json``: the full model's and the
    mask's mean over the tasks the full model passes, the share, lost/gained probes, and the command. Where
    several runs measured that length (a report run and a ratio sweep's), the one with the most probes."""
    results = eval_record(folder).get("results", [])
    rows = [r for r in results if (r.get("dataset_args") or {}).get("task") == "headline"]
    if not rows:
        return None
    length = min(r["dataset_args"]["length"] for r in rows)
    rows = [r for r in rows if r["dataset_args"]["length"] == length]

    def probes(command: str | None) -> int:  # the run's probes at that length: its per-task rows' n
        return sum((r.get("metric_args") or {}).get("n", 0) for r in results
                   if r.get("command") == command and r["metric_config"] == "leank"
                   and r["dataset_args"].get("length") == length and r["dataset_args"].get("task") != "headline")

    best = max(dict.fromkeys(r.get("command") for r in rows), key=probes)  # first-written on ties
    at = {r["metric_config"]: r for r in rows if r.get("command") == best}
    if "full" not in at or "leank" not in at:
        return None
    full, leank = at["full"], at["leank"]
    paired = leank.get("metric_args", {}).get("paired_vs_full", {})
    return {
        "length": length,
        "full": full["value"],
        "leank": leank["value"],
        "share": leank["value"] / full["value"] if full["value"] else float("nan"),
        "lost": paired.get("only_full"),
        "gained": paired.get("only_method"),
        "tasks": leank["dataset_args"].get("tasks", []),
        "command": leank.get("command"),
        "rule": leank.get("metric_args", {}).get("rule"),
    }


def mask_facts(folder: Path) -> dict[str, Any]:
    import torch

    from leank_infer import ChannelMask

    mask = ChannelMask.from_dir(folder)
    s = mask.stats(dtype=torch.bfloat16)
    return {"mask": mask, "stats": s, "headline": headline(folder)}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _share(h: dict[str, Any] | None) -> str:
    if h is None:
        return "not measured here"
    rule = ", positional rule" if h.get("rule") == "positional" else ""
    return (f"{h['leank']:.3f} vs {h['full']:.3f} = **{100 * h['share']:.0f}%** "
            f"(-{h['lost']}/+{h['gained']} probes, {h['length']} tokens{rule})")


# ---- generated markdown -----------------------------------------------------------------------------------
def masks_table(link: Callable[[str], str]) -> str:
    """The headline table of every published mask, and the commands that produced its numbers."""
    lines = [
        "| mask | base model | ratio | K kept | heads with no channel | KV bytes per pruned token (bf16) | "
        "headline accuracy, LeanK vs full = share |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    commands: dict[str, list[str]] = {}
    for folder in mask_folders():
        f = mask_facts(folder)
        s, b, h = f["stats"], f["stats"]["bytes_per_token"], f["headline"]
        lines.append(
            f"| [{folder.name}]({link(folder.name)}) | {f['mask'].base_model} | {f['mask'].ratio:g} | "
            f"{_pct(s['k_kept_fraction'])} | {s['zero_heads']} of {s['total_heads']} | "
            f"{b['leank']:,} of {b['dense']:,} ({b['leank_over_dense']:.2f}x) | {_share(h)} |"
        )
        if h and h["command"]:
            commands.setdefault(h["command"], []).append(folder.name)
    out = ["\n".join(lines), ""]
    out.append(
        "Ratio, K kept, empty heads and bytes: `ChannelMask.stats()` of each folder "
        f"(`{STATS_COMMAND.format(folder='hub/smollm2-135m-instruct-s3')}`, one folder at a time). "
        "Headline accuracy: the mean over the tasks the full model passes (at least 80%) of the "
        "evaluation suite, from each folder's `eval.json`, written by these runs:"
    )
    out.append("")
    out += [f"- {', '.join(names)}: `{cmd}`" for cmd, names in commands.items()]
    out.append("")
    out.append("Masks marked \"not measured here\" were imported from the paper's release; "
               "their cards quote what the authors report.")
    return "\n".join(out)


# ---- which mask to use -----------------------------------------------------------------------------------
#: the recommendations: which committed mask for which use, prompt length and engine. The masks were chosen
#: among candidates on the development seeds (docs/evaluation.md, "Dev and report seeds"); the numbers that
#: back each row are read from the mask's ``eval.json`` (the report seed) when the table is drawn.
DEFAULT_ENGINES = "both, default rule"
RECOMMENDED: list[dict[str, Any]] = [
    {"mask": "smollm2-135m-instruct-s3", "use": "short prompts",
     "up_to": 2048, "engines": DEFAULT_ENGINES, "positional": False},
    {"mask": "smollm2-135m-instruct", "use": "long prompts, closest to the full model",
     "up_to": 4096, "engines": DEFAULT_ENGINES, "positional": False},
    {"mask": "smollm2-135m-instruct-r80-s3-8k", "use": "long prompts, the fewest bytes",
     "up_to": 4096, "engines": DEFAULT_ENGINES, "positional": False},
    {"mask": "smollm2-135m-instruct-s3-positional", "use": "more requests at once",
     "up_to": 2048, "engines": "vLLM, `leank_rule: positional`", "positional": True},
]


def headlines_by_length(folder: Path, positional: bool = False) -> dict[int, dict[str, Any]]:
    """Per length, the mask's headline against the full model's from ``eval.json``: under the positional rule or
    not, and where several runs measured a length, the one with the most probes there (as :func:`headline`)."""
    results = eval_record(folder).get("results", [])
    runs: dict[tuple[int, str], dict[str, dict[str, Any]]] = {}
    for r in results:
        args = r.get("dataset_args") or {}
        if args.get("task") != "headline" or r["metric_config"] not in ("full", "leank"):
            continue
        is_positional = (r.get("metric_args") or {}).get("rule") == "positional"
        if r["metric_config"] == "leank" and is_positional != positional:
            continue
        runs.setdefault((args["length"], r.get("command")), {})[r["metric_config"]] = r
    n_of: dict[tuple[int, str], dict[str, int]] = {}  # the full model's probes per task of each run and length
    for r in results:
        args = r.get("dataset_args") or {}
        if r["metric_config"] == "full" and args.get("task") != "headline":
            n_of.setdefault((args.get("length"), r.get("command")), {})[args["task"]] = r["metric_args"]["n"]
    out: dict[int, dict[str, Any]] = {}
    for (length, command), at in runs.items():
        if "full" not in at or "leank" not in at:
            continue
        per_task = n_of.get((length, command), {})
        tasks = at["leank"]["dataset_args"].get("tasks", [])
        if length in out and out[length]["all_probes"] >= sum(per_task.values()):
            continue
        paired = at["leank"].get("metric_args", {}).get("paired_vs_full", {})
        out[length] = {"full": at["full"]["value"], "leank": at["leank"]["value"], "tasks": len(tasks),
                       "probes": sum(per_task.get(t, 0) for t in tasks), "measured": len(per_task),
                       "all_probes": sum(per_task.values()), "lost": paired.get("only_full"),
                       "gained": paired.get("only_method"), "command": command}
    return dict(sorted(out.items()))


def _length(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def which_mask_table(link: Callable[[str], str]) -> str:
    """The one recommendation: which mask for which use, length and engine, each row's reasons read from the
    mask's ``eval.json`` (report seed) at every length it was measured."""
    lines = ["| mask | use | prompt | engine | bytes | why: headline vs the full model (report seed) |",
             "|---|---|---|---|---:|---|"]
    for rec in RECOMMENDED:
        folder = HUB / rec["mask"]
        if not (folder / "config.json").is_file():
            raise ValueError(f"the recommended mask hub/{rec['mask']} is not committed")
        b = mask_facts(folder)["stats"]["bytes_per_token"]
        heads = headlines_by_length(folder, rec["positional"])
        if rec["up_to"] not in heads and not any(n > rec["up_to"] for n in heads):
            raise ValueError(f"hub/{rec['mask']}/eval.json has no run at {rec['up_to']} tokens or longer, "
                             "which its recommended length needs")
        why = "; ".join(f"{_length(n)} {h['leank']:.3f} vs {h['full']:.3f} (-{h['lost']}/+{h['gained']} of "
                        f"{h['probes']})" for n, h in heads.items())
        lines.append(f"| [{rec['mask']}]({link(rec['mask'])}) | {rec['use']} | up to {_length(rec['up_to'])} | "
                     f"{rec['engines']} | {b['leank_over_dense']:.2f}x | {why} |")
    # the longest length any card measured: what the full model itself can do there
    runs = [(n, h) for f in mask_folders() for n, h in headlines_by_length(f).items()]
    n = max(length for length, _ in runs)
    h = max((h for length, h in runs if length == n), key=lambda h: h["all_probes"])
    per_task = h["all_probes"] // max(h["measured"], 1)
    lines.append(f"| none judged | | {_length(n)} | both | | the full model passes "
                 f"{h['tasks']} of the {h['measured']} tasks measured there ({per_task} probes each): "
                 "too little to choose a mask on |")
    return "\n".join(lines)


def cpu_time(recipe: Path) -> str:
    """The first sentence of a recipe's ``# CPU time:`` header comment (what its run cost, measured), or ""."""
    lines = [line.removeprefix("#").strip() for line in recipe.read_text().splitlines() if line.startswith("#")]
    start = next((i for i, line in enumerate(lines) if line.startswith("CPU time:")), None)
    if start is None:
        return ""
    text = lines[start].removeprefix("CPU time:").strip()
    for line in lines[start + 1:]:
        if text.endswith(".") or not line:
            break
        text += " " + line
    return text.split(". ")[0].rstrip(".").replace("|", "/")


def recipes_table(link: Callable[[str], str]) -> str:
    """Which recipe gives which mask, what the mask costs and how it scores (from the committed folders)."""
    from leank_train.pipeline import load_recipe

    lines = [
        "| recipe | base model | stage 2 starts from | ratio | stage 2 | prompt tokens | mask | KV bytes per pruned token (bf16) | "
        "headline accuracy, LeanK vs full = share | CPU time (the recipe's `# CPU time:`) |",
        "|---|---|---|---:|---|---|---|---:|---|---|",
    ]
    for path in sorted(RECIPES.glob("*.yaml")):
        r = load_recipe(path)
        start = f"`{r.stage1_dir}`" if r.stage1_dir else "its own stage 1"
        s2 = r.stage2
        anneal = (f", ratio annealed from {s2.ratio_start:g} over {s2.ratio_anneal_steps} steps"
                  if s2.ratio_start is not None and s2.ratio_anneal_steps > 0 else "")
        whole = f", min_kept {s2.min_kept}" if s2.min_kept else ""
        stage2 = f"{s2.steps} steps{anneal}{whole}"
        folder = ROOT / r.compare_to if r.compare_to else None
        if folder is not None and (folder / "config.json").is_file():
            f = mask_facts(folder)
            b = f["stats"]["bytes_per_token"]
            mask = f"[{folder.name}]({link(folder.name)})"
            if (f["mask"].extra or {}).get("provenance"):  # imported: the run is compared with it, did not make it
                mask = f"none trained here; compares with the imported {mask}"
            cost = f"{b['leank']:,} ({b['leank_over_dense']:.2f}x)"
            score = _share(f["headline"])
        else:
            mask, cost, score = "none committed", "", ""
        lines.append(f"| `recipes/{path.name}` | {r.base_model} | {start} | {r.ratio:g} | {stage2} | "
                     f"{r.min_length:,}-{r.max_length:,} | {mask} | "
                     f"{cost} | {score} | {cpu_time(path)} |")
    return "\n".join(lines)


def suite_table(link: Callable[[str], str]) -> str:
    """Per task, the full model and each evaluated mask on the same probes (shortest length in ``eval.json``, the
    run :func:`headline` takes), then each method's headline; cells ``correct/n (-lost/+gained)``."""
    heads = {f: h for f in mask_folders() if (h := headline(f)) is not None}
    folders = list(heads)
    if not folders:
        return "No committed mask has evaluation results."
    length = min(h["length"] for h in heads.values())
    cells: dict[tuple[str, str, str], dict[str, Any]] = {}
    tasks: list[str] = []
    for folder in folders:
        run = heads[folder]["command"]  # the run the headline comes from (a card may hold several at a length)
        for r in eval_record(folder)["results"]:
            args = r.get("dataset_args") or {}
            if args.get("length") != length or r.get("command") != run:
                continue
            task = args["task"]
            if task not in tasks:
                tasks.append(task)
            cells[(folder.name, task, r["metric_config"])] = r
    first = folders[0].name
    for folder in folders[1:]:  # every mask was measured on the same probes: the full model agrees
        for task in tasks:
            a, b = cells.get((first, task, "full")), cells.get((folder.name, task, "full"))
            if a and b and a["value"] != b["value"]:
                raise ValueError(f"{folder.name}: the full model's {task} differs from {first}'s: not the same probes")

    def cell(name: str, task: str, method: str) -> str:
        r = cells.get((name, task, method))
        if r is None:
            return ""
        args = r.get("metric_args") or {}
        paired = args.get("paired_vs_full") or {}
        if task == "headline":
            text = f"{r['value']:.3f} +/- {args['se']:.3f}"
        else:
            text = f"{args['correct']}/{args['n']}"
        if paired:
            p = f", p={paired['mcnemar_p']:.2g}" if task == "headline" and "mcnemar_p" in paired else ""
            text += f" (-{paired['only_full']}/+{paired['only_method']}{p})"
        return text

    names = [f.name for f in folders]
    out = [f"{length} tokens, the learned masks (`leank`):", "",
           "| task | full | " + " | ".join(f"[{n}]({link(n)})" for n in names) + " |",
           "|---|---|" + "---|" * len(names)]
    for task in tasks:
        label = "**headline**" if task == "headline" else task
        out.append(f"| {label} | {cell(first, task, 'full')} | "
                   + " | ".join(cell(n, task, "leank") for n in names) + " |")
    out += ["", f"{length} tokens, the baselines at each mask's K budget (headline):", "",
            "| method | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for method in ("random", "think"):
        out.append(f"| {method} | " + " | ".join(cell(n, "headline", method) for n in names) + " |")
    tasks_used = heads[folders[0]]["tasks"]
    out += ["", f"Headline tasks (the full model at least 80%): {', '.join(tasks_used)}. "
            "Each folder's `eval.json` holds these rows; the commands that measured them are on each mask's page."]
    return "\n".join(out)


def results_table(name: str) -> str:
    """A benchmark's saved table (``benchmarks/results.py``) with the command and the date it was measured."""
    r = json.loads((RESULTS / f"{name}.json").read_text())
    return (
        f"{r['markdown']}\n\nMeasured {r['date']} ({r['cpus']} CPUs, load average {r['load_1min']} at the end):\n\n"
        f"```bash\n{r['command']}\n```\n"
    )


def _help_text(name: str) -> str:
    """``leank NAME --help`` as the real parser prints it (100 columns), without running the command."""
    from leank_infer import cli

    os.environ["COLUMNS"] = "100"
    func = cli._load(name)
    if name in cli.RAW_ARGV:  # `fit` is LightningCLI: it prints its own help and exits
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            func(["--help"])
        return buf.getvalue()
    return cli.command_parser(func, f"leank {name}").format_help()


def cli_reference() -> str:
    from leank_infer import cli

    out = ["```text", cli._help().rstrip(), "```", ""]
    for name, (target, summary) in cli.COMMANDS.items():
        out += [f"## leank {name}", "", f"{summary[0].upper()}{summary[1:]} (`{target}`).", ""]
        text = _help_text(name).rstrip()
        if name in cli.RAW_ARGV:
            out += ['??? note "`leank fit --help` (LightningCLI\'s own parser, every Trainer option)"', ""]
            out += ["    ```text", *("    " + line if line else "" for line in text.splitlines()), "    ```", ""]
        else:
            out += ["```text", text, "```", ""]
    return "\n".join(out)


def mask_page(folder: Path) -> str:
    """The docs page of one mask folder: the card, then the page's provenance and the runs behind it."""
    card = (folder / "README.md").read_text()
    card = re.sub(r"\A---\n.*?\n---\n", "", card, flags=re.S).lstrip()  # the Hub metadata block
    first, _, body = card.partition("\n")
    title = f"# {folder.name}: {first.removeprefix('# ')}" if first.startswith("# ") else f"# {folder.name}"
    body = body if first.startswith("# ") else card
    record = eval_record(folder)
    runs = []
    for cmd in dict.fromkeys(r.get("command") for r in record.get("results", []) if r.get("command")):
        runs.append(("evaluation rows", cmd, git_date(folder / "eval.json", cmd)))
    for name, cmd in (record.get("figures") or {}).items():
        runs.append((f"figure `{name}`", cmd, git_date(folder / name)))
    lines = [
        "## About this page",
        "",
        f"This page is the model card of `hub/{folder.name}/` (its `README.md`, generated by "
        "`leank_infer/hub/card.py` from the folder's `config.json`, `mask.safetensors` and `eval.json`), "
        "rendered when the docs are built.",
        "",
    ]
    if runs:
        lines += ["| what | command | results committed |", "|---|---|---|"]
        lines += [f"| {what} | `{cmd}` | {date or 'no git history'} |" for what, cmd, date in runs]
        lines.append("")
    return f"{title}\n{body.rstrip()}\n\n" + "\n".join(lines)  # the card's headline first, as on the Hub


# ---- mkdocs hooks -----------------------------------------------------------------------------------------
def on_config(config, **kwargs):
    entries = [{folder.name: f"masks/{folder.name}/index.md"} for folder in mask_folders()]
    for i, item in enumerate(config["nav"]):
        if isinstance(item, dict) and item.get("Published masks") == "masks.md":
            config["nav"][i] = {"Published masks": ["masks.md", *entries]}
    return config


def on_files(files, config, **kwargs):
    from mkdocs.structure.files import File

    for folder in mask_folders():
        files.append(File.generated(config, f"masks/{folder.name}/index.md", content=mask_page(folder)))
        for path in sorted(folder.iterdir()):
            if path.suffix == ".png" or path.name == "LICENSE":
                files.append(File.generated(config, f"masks/{folder.name}/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files, **kwargs):
    depth = page.file.src_uri.count("/")
    prefix = "../" * depth

    def link(name: str) -> str:
        return f"{prefix}masks/{name}/index.md"

    generators = {
        "masks-table": lambda: masks_table(link),
        "recipes-table": lambda: recipes_table(link),
        "suite-table": lambda: suite_table(link),
        "which-mask": lambda: which_mask_table(link),
        "cli": cli_reference,
    }

    def replace(m: re.Match) -> str:
        if m.group(1) in generators:
            return generators[m.group(1)]()
        if (RESULTS / f"{m.group(1)}.json").is_file():
            return results_table(m.group(1))
        raise ValueError(f"{page.file.src_uri}: unknown marker {m.group(0)} (and no docs/results/{m.group(1)}.json)")

    return MARKER.sub(replace, markdown)


if __name__ == "__main__":
    if sys.argv[1:] != ["masks-table"]:
        sys.exit("usage: python docs/hooks/leank_docs.py masks-table")
    print(masks_table(lambda name: f"hub/{name}/"))
