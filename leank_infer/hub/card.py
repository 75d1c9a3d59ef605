"""Model cards and pattern plots for mask repos, generated from the repo's files (never hand-edited)."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..mask import ChannelMask, update_mask_folder

# Licenses of base models we publish masks for; anything else is left for the user to fill in.
KNOWN_LICENSES = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "apache-2.0",
    "meta-llama/Llama-3.1-8B-Instruct": "llama3.1",
    "Qwen/Qwen2.5-7B-Instruct": "apache-2.0",
    "Qwen/Qwen3-8B": "apache-2.0",
    "mistralai/Mistral-7B-Instruct-v0.3": "apache-2.0",
}

CARD_TEMPLATE = """\
{card_data}
# LeanK mask for {base_model}

{headline}

{purpose}

{learned_on}## The mask

| | value |
|---|---|
| K channels kept | {k_pct:.1f}% |
| V kept (heads with >= 1 channel) | {v_pct:.1f}% |
| heads with zero channels | {zero_heads} of {total_heads} |
| KV bytes / pruned token ({dtype}) | {leank_bytes:,} vs {dense_bytes:,} dense ({bytes_ratio:.3f}x) |
| sink / recent / accumulation tokens | {sink} / {recent} / {accumu} |
| ratio / align | {ratio} / {align} |

Numbers from `{stats_command}`.

![Kept channels per layer and head](pattern.png)

{pattern_caption}

## Usage

```python
{usage}
```

{capacity}{results}{figures}{provenance}{recipe}"""

RECIPE_SECTION = """\
## Recipe

<details markdown="1"><summary>The recipe <code>leank run</code> made this mask with (save it as a file: <code>leank run FILE</code> reruns it)</summary>

{fence}yaml
{recipe}
{fence}

</details>
"""

STATS_COMMAND = ("python -c \"import torch; from leank_infer import ChannelMask; "
                 "print(ChannelMask.from_pretrained('{repo}').stats(dtype=torch.bfloat16))\"")

def code_fence(text: str) -> str:
    """A Markdown code fence ``text`` cannot close: longer than any run of backticks in it (CommonMark), so a
    recipe's text stays inside its block and cannot add Markdown (links, images, HTML) to the card."""
    import re

    return "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))

def inline_code(text: str) -> str:
    """``text`` as one Markdown code span it cannot close (CommonMark: a longer run of backticks, padded with
    spaces; line breaks made spaces), so a recorded command cannot add Markdown or live HTML to the card."""
    import re

    text = " ".join(str(text).split())
    ticks = "`" * (1 + max((len(run) for run in re.findall(r"`+", text)), default=0))
    pad = " " if "`" in text else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def html_code(text: str) -> str:
    """``text`` as an HTML code element, escaped: a recorded command inside a folded ``<details>`` block (raw HTML to
    renderers without Markdown-in-HTML) cannot add live HTML or Markdown to the card."""
    import html

    return f"<code>{html.escape(' '.join(str(text).split()))}</code>"


USAGE = """\
from leank_infer import LeanKModel

m = LeanKModel.from_pretrained("{repo}")
# pruning starts past the first {sink} + last {recent} tokens: this prompt is longer
notes = " ".join(f"Note {{i}}: the shop opens at nine." for i in range({notes}))
messages = [{{"role": "user", "content": f"{{notes}} The passkey is 4721. {{notes}} What is the passkey?"}}]
inputs = m.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = m.generate(**inputs, max_new_tokens=16, do_sample=False)
print(m.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))"""


def family_of(model_id: str | None) -> str | None:
    name = (model_id or "").lower()
    for fam in ("smollm", "llama", "qwen3", "qwen2", "mistral", "gemma", "phi"):
        if fam in name:
            return "llama" if fam == "smollm" else fam
    return None


def plot_pattern(mask: ChannelMask, path: str | Path) -> Path:
    """Save the picture the paper uses: stage-1 scores (or kept channels) per layer x head x channel, and the
    channels each head keeps; every axis and colour bar says what it shows (the card's caption says the rest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = mask.scores is not None
    values = mask.scores if scored else mask.keep.float()
    layers, heads, dim = values.shape
    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(12, max(3.5, layers * 0.18)), gridspec_kw={"width_ratios": [4, 1]}
    )
    im = ax1.imshow(values.reshape(layers, heads * dim).numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1,
                    interpolation="nearest")
    for h in range(1, heads):
        ax1.axvline(h * dim - 0.5, color="white", linewidth=0.8)
    step = max(1, heads // 16)  # at most 16 head labels
    ax1.set_xticks([h * dim + dim / 2 - 0.5 for h in range(0, heads, step)], [str(h) for h in range(0, heads, step)])
    ax1.set_xlabel(f"KV head (each band: its {dim} K channels)")
    ax1.set_ylabel("layer")
    ax1.set_title("stage-1 learned scaler of each K channel" if scored else "kept K channels (1 kept, 0 pruned)")
    bar = fig.colorbar(im, ax=ax1, fraction=0.03)
    if scored:
        bar.set_label("learned scaler (near 1: the channel matters)")
    else:
        bar.set_ticks([0, 1], labels=["pruned", "kept"])
        bar.set_label("K channel for pruned tokens")
    counts = mask.kept_counts.numpy()
    im2 = ax2.imshow(counts, aspect="auto", cmap="magma", vmin=0, vmax=dim, interpolation="nearest")
    ax2.set_xticks(range(0, heads, step), [str(h) for h in range(0, heads, step)])
    ax2.set_xlabel("KV head")
    ax2.set_ylabel("layer")
    ax2.set_title("K channels kept per head")
    bar2 = fig.colorbar(im2, ax=ax2, fraction=0.08)
    bar2.set_label(f"channels kept (of {dim}; 0: K and V dropped)")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def learned_on(mask: ChannelMask) -> str:
    """What the mask was learned on beyond the base model's id (revision, PEFT adapter, config
    overrides such as YaRN), which ``LeanKModel.from_pretrained`` reproduces; "" when nothing more."""
    import json

    parts = []
    if mask.base_revision:
        parts.append(f"- base model revision: `{mask.base_revision}`")
    if mask.adapter:
        rev = f" at `{mask.adapter_revision}`" if mask.adapter_revision else ""
        parts.append(f"- PEFT adapter `{mask.adapter}`{rev}, merged into the base weights")
    for name, value in mask.config_overrides.items():
        parts.append(f"- config override `{name}` = `{json.dumps(value)}`")
    if not parts:
        return ""
    head = "Learned on, and loaded by `LeanKModel.from_pretrained` with:\n\n"
    return head + "\n".join(parts) + "\n\n"


def provenance_section(mask: ChannelMask) -> str:
    """Where an imported mask comes from, its licence, and what its authors report (never measured here)."""
    src = (mask.extra or {}).get("provenance")
    if not isinstance(src, dict):
        return ""
    commit = src.get("commit") or ""
    url = f"{src.get('source')}/blob/{commit}/{src.get('path')}" if commit else f"{src.get('source')}"
    lines = [
        "## Provenance and licence",
        "",
        f"Not trained by leank. Learned by {src.get('trained_by', 'its authors')} and released at "
        f"[{src.get('path')}]({url}) (commit `{commit[:12]}`, sha256 `{src.get('sha256')}`), "
        f"converted unchanged by `{src.get('converted_by', 'leank import')}` into `mask.safetensors` "
        "(the original file is a PyTorch pickle; leank read it once with PyTorch's weights-only loader).",
        "",
        f"Licence of the mask: {src.get('license')}, {src.get('copyright')}; the full text is "
        f"[`{src.get('license_file', 'LICENSE')}`]({src.get('license_file', 'LICENSE')}) in this folder and must "
        "travel with every copy. The base model has its own licence.",
        "",
        f"Decode sizes are the reference's defaults: sink {mask.sink_size}, recent {mask.recent_size}, "
        f"accumulation {mask.accumu_size}; ratio {mask.ratio} and align {mask.align} are derived from the mask itself.",
        "",
    ]
    s = mask.stats()
    lines += [
        f"Checked against the paper: this mask removes {1 - s['k_kept_fraction']:.1%} of the K channels and the V of "
        f"{s['zero_heads']} of {s['total_heads']} KV heads ({1 - s['v_kept_fraction']:.1%} of V) for middle tokens; "
        "the authors report about 70% of K and 16%-18% of V removed.",
        "",
    ]
    lines += [f"Note: {n}\n" for n in src.get("notes") or []]
    reported = src.get("reported") or []
    if reported:
        lines += ["## Reported by the authors (not measured here)", "",
                  "Quoted from the authors' paper and repository; leank has not reproduced these numbers:", ""]
        lines += [f"- {r}" for r in reported] + [""]
    return "\n".join(lines) + "\n"


def capacity_section(mask: ChannelMask, repo: str, gpu_gib: float = 80.0) -> str:
    """Largest batch on one GPU, dense vs LeanK, when the folder records its base model's size."""
    import torch

    from ..mask.capacity import ASSUMPTION, base_parameters, capacity_table

    n = base_parameters(mask)
    if n is None:
        return ""
    weights = n * 2
    return (
        f"## Capacity on one {gpu_gib:g} GiB GPU (bf16)\n\n"
        f"`leank bench {repo} --capacity {gpu_gib:g}` (base model {n / 1e9:.2f} B parameters, "
        f"{weights / 1024**3:.2f} GiB of bf16 weights):\n\n"
        f"{capacity_table(mask, gpu_gib, weights, torch.bfloat16)}\n\n"
        f"Assumption: {ASSUMPTION}.\n\n"
    )


def _length(row: dict[str, Any]) -> int | None:
    """The prompt length a result row was measured at: its ``dataset_args`` length, else ``N tokens`` in its name."""
    import re

    n = (row.get("dataset_args") or {}).get("length")
    if isinstance(n, int):
        return n
    m = re.search(r"(\d+) tokens\b", str(row.get("dataset", "")))
    return int(m.group(1)) if m else None


def _task(row: dict[str, Any]) -> str:
    """A row's label in its length's table: the suite task, or its dataset name without the length."""
    import re

    task = (row.get("dataset_args") or {}).get("task")
    return str(task) if task else re.sub(r",?\s*\d+ tokens\b", "", str(row.get("dataset", ""))).strip() or "?"


def _method(row: dict[str, Any]) -> str:
    return str(row.get("metric_config") or row.get("metric", "accuracy"))


def _cell(row: dict[str, Any]) -> str:
    """``correct/n`` (-lost/+gained against the full model) for a suite row, ``mean ± s.e. (-lost/+gained, p)``
    for a headline row; other rows their ``text``, else their value."""
    args = row.get("metric_args") or {}
    paired = args.get("paired_vs_full") or {}
    if _task(row) == "headline" and "se" in args:
        p = f", p={paired['mcnemar_p']:.2g}" if "mcnemar_p" in paired else ""
        tail = f" (-{paired['only_full']}/+{paired['only_method']}{p})" if "only_full" in paired else ""
        return f"{row['value']:.3f} ± {args['se']:.3f}{tail}"
    if "correct" in args and "n" in args:
        tail = f" (-{paired['only_full']}/+{paired['only_method']})" if "only_full" in paired else ""
        return f"{args['correct']}/{args['n']}{tail}"
    return str(row.get("text") or f"{row['value']:.3f}")


METHOD_NAMES = {"full": "full model", "leank": "LeanK", "random": "random channels", "think": "ThinK"}


def best_runs(rows: list[dict[str, Any]]) -> dict[int, str | None]:
    """Per length, the command whose run has the most probes there (first written on ties): the run the card's
    headline and the Hub metadata take where several runs measured one length."""
    def probes(command: str | None, n: int) -> int:
        mine = [r for r in rows if r.get("command") == command and _length(r) == n and _task(r) != "headline"]
        leank = [r for r in mine if _method(r) == "leank"] or mine
        return sum(int((r.get("metric_args") or {}).get("n", 1)) for r in leank)

    lengths = sorted({n for r in rows if (n := _length(r)) is not None})
    return {n: max(dict.fromkeys(r.get("command") for r in rows if _length(r) == n), key=lambda c: probes(c, n))
            for n in lengths}


def hub_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows the Hub metadata (model-index) carries: at a length whose runs have a headline, the headline rows
    of the run with the most probes (every row stays in the card's tables and in ``eval.json``); all other rows."""
    best = best_runs(rows)
    headed = {_length(r) for r in rows if _task(r) == "headline"} - {None}
    return [r for r in rows if _length(r) not in headed
            or (_task(r) == "headline" and r.get("command") == best[_length(r)])]


def headline_line(rows: list[dict[str, Any]], bytes_ratio: float) -> str:
    """The card's first line: the bytes the mask keeps and, per length, LeanK's headline against the full model's."""
    said = f"**{bytes_ratio:.0%} of the dense KV bytes for every pruned token"
    best = best_runs(rows)
    parts = []
    for n, command in best.items():
        at = {_method(r): r for r in rows if _length(r) == n and r.get("command") == command and _task(r) == "headline"}
        if "full" in at and "leank" in at:
            paired = (at["leank"].get("metric_args") or {}).get("paired_vs_full") or {}
            lost = f" (-{paired['only_full']}/+{paired['only_method']} probes)" if "only_full" in paired else ""
            parts.append(f"{at['leank']['value']:.3f} vs {at['full']['value']:.3f} at {n:,} tokens{lost}")
    if parts:
        return said + "; headline accuracy, LeanK vs the full model: " + ", ".join(parts) + ".**"
    if rows:
        return said + "; its accuracy is under Results below.**"
    return said + "; not evaluated here.**"


def results_section(rows: list[dict[str, Any]], default_command: str, commands: Sequence[str]) -> str:
    """One table per prompt length (rows: the runs' tasks, columns: the methods), then the ``commands`` of the runs
    (each row's ``command``, ``default_command`` where it has none), numbered as the tables' ``run`` column, folded."""
    runs = {c: i for i, c in enumerate(commands, 1)}
    several = len(runs) > 1
    lengths = sorted({n for r in rows if (n := _length(r)) is not None}) + (
        [None] if any(_length(r) is None for r in rows) else [])
    out = []
    for n in lengths:
        mine = [r for r in rows if _length(r) == n]
        methods = list(dict.fromkeys(_method(r) for r in mine))
        methods.sort(key=lambda m: m != "full")  # the full model first
        keys = list(dict.fromkeys((r.get("command", default_command), _task(r)) for r in mine))
        keys.sort(key=lambda k: (runs[k[0]], k[1] != "headline"))  # per run, its headline first
        cells = {(r.get("command", default_command), _task(r), _method(r)): _cell(r) for r in mine}
        head = (["run"] if several else []) + ["task"] + [METHOD_NAMES.get(m, m) for m in methods]
        lines = [f"### {n:,} tokens" if n is not None else "### Other results", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for command, task in keys:
            label = "**headline**" if task == "headline" else task
            lines.append("| " + " | ".join(([str(runs[command])] if several else []) + [label] + [
                cells.get((command, task, m), "") for m in methods]) + " |")
        out.append("\n".join(lines) + "\n")
    if any("correct" in (r.get("metric_args") or {}) or _task(r) == "headline" for r in rows):
        out.append("Cells: probes answered / probes, and (-lost/+gained) the probes the full model answered and the "
                   "method missed / the reverse, on the same prompts. **headline**: the mean over the tasks the full "
                   "model passes, ± its standard error, with McNemar's p against the full model. random channels / "
                   "ThinK: as many K channels per head as the mask, drawn at random / chosen by ThinK from the "
                   "prompt. `eval.json` holds every row with its 95% interval; the Hub metadata holds each length's "
                   "headline.\n")
    listed = "\n".join(f"{i}. {html_code(c)}" for c, i in runs.items())
    what = "The commands that measured these rows (the `run` column)" if several else "The command that measured these rows"
    out.append(f'<details markdown="1"><summary>{what}</summary>\n\n{listed}\n\n</details>\n')
    return "\n".join(out) + "\n"


def kv_quant_section(record: dict[str, Any] | list[dict[str, Any]] | None) -> str:
    """The card's "KV quantisation" section: the runs that measured the mask with its middle quantised
    (``kv_quant``, a decode setting: the mask is the same), each method's bytes per token next to its headline.
    The runs (one per length, say) share one table, a column per length, their commands folded under it; runs
    that count bytes at another length get a table of their own."""
    records = [record] if isinstance(record, dict) else list(record or [])
    if not records:
        return ""
    out = [
        "## KV quantisation\n\nThe mask is unchanged; `kv_quant=\"int8\"` or `\"int4\"` (`LeanKModel.from_pretrained(mask, "
        "kv_quant=...)`, `--kv-quant`) stores the middle's kept K channels (per channel) and its V (per token) "
        "quantised; sink and recent tokens stay in full precision. QuantizedCache: transformers' cache, every channel "
        "quantised.\n\n"
    ]
    for at in dict.fromkeys(rec["bytes_at"] for rec in records):
        group = [rec for rec in records if rec["bytes_at"] == at]
        lengths = sorted({n for rec in group for n in rec["lengths"]})
        cells: dict[tuple[str, str, float], dict[str, str]] = {}
        for rec in group:
            for r in rec["rows"]:
                row = cells.setdefault((r["method"], r["kv_quant"], r["bytes_per_token"]), {})
                for n in rec["lengths"]:
                    row.setdefault(str(n), r["headline"].get(str(n), "n/a"))
        lines = [f"| method | kv_quant | KV bytes/token at {at:,} (bf16) | "
                 + " | ".join(f"headline, {n} tokens" for n in lengths) + " |", "|---|---|---|" + "---|" * len(lengths)]
        lines += [f"| {method} | {quant} | {per:,.0f} | " + " | ".join(row.get(str(n), "") for n in lengths) + " |"
                  for (method, quant, per), row in cells.items()]
        listed = "\n".join(f"{i}. {', '.join(f'{n:,}' for n in rec['lengths'])} tokens: {html_code(rec['command'])}"
                           for i, rec in enumerate(group, 1))
        out.append("\n".join(lines) + "\n\n"
                   + f'<details markdown="1"><summary>The commands of this table</summary>\n\n{listed}\n\n</details>\n\n')
    for probes in dict.fromkeys(rec.get("samples_per_task") for rec in records):
        if probes is not None:  # one sentence for the runs of as many probes
            tasks = [f"{n} tokens: {', '.join(t)}" for rec in records if rec.get("samples_per_task") == probes
                     for n, t in rec.get("headline_tasks", {}).items()]
            out.append(f"{probes} probes per task and length; the headline is the mean over the tasks the full model "
                       f"passes ({'; '.join(tasks)}), +/- its standard error.\n\n")
    return "".join(out)


def figure_caption(name: str, command: str, runs: dict[str, int], kv_runs: dict[str, str] | None = None) -> str:
    """What a figure of the card shows, which of the card's runs it was drawn from (or that it is a run of its own,
    whose numbers the tables need not match), and its command, folded."""
    import shlex

    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()

    def values(flag: str) -> list[str]:
        if flag not in words:
            return []
        rest = words[words.index(flag) + 1:]
        return rest[: next((i for i, w in enumerate(rest) if w.startswith("--")), len(rest))]

    accuracy = "eval" in words[:2] or any(w.endswith("eval_masks.py") for w in words[:2])
    if "--sweep-plot" in words:
        what = ("Headline score at each length (left; dashed: the full model) and KV bytes per pruned token "
                "(right) against the fraction of K channels pruned, one point per mask of the sweep.")
    elif "bench" in words[:2]:
        what = ("Median decode-step time against context length, dense (dashed) and LeanK, per batch size, "
                "on the machine that ran the command.")
    elif "--kv-quants" in words or "--hf-quants" in words:
        what = ("KV bytes per token against the headline score, one point per method (the mask, the mask with its "
                "middle quantised, transformers' QuantizedCache); dotted: the methods no other beats on both.")
    elif accuracy:
        what = "Accuracy against prompt length, one line per method (+/- 1 standard error)."
    else:
        what = ""
    saved = [p for p in values("--from-json")]
    used = [runs[c] for c in runs if any(f"--json {p}" in c for p in saved)]
    if command in runs:
        source = f"Drawn from run {runs[command]} of the tables above."
    elif command in (kv_runs or {}):
        source = f"Drawn from the KV quantisation run at {(kv_runs or {})[command]} above."
    elif saved and len(used) == len(saved):
        source = f"Drawn from the saved results of runs {', '.join(map(str, used))} of the tables above."
    elif accuracy:
        kinds, tasks, samples = values("--kinds"), values("--tasks"), values("--samples")
        on = (f" on the needle kinds {', '.join(kinds)}" if kinds else f" on the tasks {', '.join(tasks)}" if tasks
              else "")
        probes = f", {samples[0]} probes per length" if samples else ""
        source = (f"Drawn by a run of its own, not one of the tables above{',' if on else ''}{on}{probes}: its scores, the full "
                  "model's too, are not comparable with the tables'.")
    else:
        source = ""
    text = " ".join(t for t in (what, source) if t)
    if command in runs or command in (kv_runs or {}):  # its command is listed with that run's
        return f"![{name}]({name})\n\n**Figure** ({name}). {text}\n\n"
    return (f"![{name}]({name})\n\n**Figure** ({name}). {text}\n\n"
            f'<details markdown="1"><summary>Command</summary>\n\n{html_code(command)}\n\n</details>\n\n')


class _Inline(dict):
    """A mapping YAML writes on one line (flow style)."""


class _InlineList(list):
    """A list YAML writes on one line (flow style)."""


def _dump_yaml(data: Any, width: int) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(_Inline, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v, flow_style=True))
    Dumper.add_representer(_InlineList, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, allow_unicode=True, width=width)


def compact_yaml(data: dict[str, Any]) -> str:
    """The card's Hub metadata as YAML with one line per result (flow style; the same data as
    ``ModelCardData.to_yaml``, which spends a line on every key: several hundred lines for a suite)."""
    data = dict(data)
    if isinstance(data.get("tags"), list):
        data["tags"] = _InlineList(data["tags"])
    index = [{**model, "results": [_Inline(res) for res in model.get("results", [])]}
             for model in data.get("model-index") or []]
    if index:
        data["model-index"] = index
    return _dump_yaml(data, width=4096)


def card_text(card: Any) -> str:
    """The README.md of a card: its metadata block (compact, :func:`compact_yaml`) and its text."""
    return f"---\n{compact_yaml(card.data.to_dict())}---\n{card.text.lstrip(chr(10))}"


def compact_recipe(recipe: str) -> str:
    """A recipe with one top-level key a line, its maps and lists inline (the same YAML in half the lines: the
    card folds it); the text as given when it is not a YAML mapping."""
    import yaml

    try:
        data = yaml.safe_load(recipe)
    except yaml.YAMLError:
        return recipe
    if not isinstance(data, dict) or not data:
        return recipe
    inline = {k: _Inline(v) if isinstance(v, dict) else _InlineList(v) if isinstance(v, list) else v
              for k, v in data.items()}
    return _dump_yaml(inline, width=110).rstrip()


_PATTERN_CAPTION = (
    "**Figure** (pattern.png). Left: {left}, one row per layer, one band per KV head (its {dim} K channels across). "
    "Right: how many K channels each head keeps for pruned tokens; a head that keeps none drops its V too. "
    "Drawn with this card: `leank card FOLDER` rewrites both from a mask folder's files.")


_EVAL_EXTRAS = ("dataset_config", "dataset_split", "dataset_args", "metric_config", "metric_args")


def check_kv_quant_records(value: Any, where: str) -> list[dict[str, Any]]:
    """``eval.json``'s ``kv_quant``: a run record (or a list of them) as :func:`kv_quant_section` reads it; anything
    else is one MaskError naming what is wrong (a stranger's file must not fail a card update half-way)."""
    from ..mask import MaskError

    records = [value] if isinstance(value, dict) else value
    if not isinstance(records, list):
        raise MaskError(f"{where}: 'kv_quant' must be a run record or a list of them; fix or delete the file")
    for i, rec in enumerate(records):
        bad = None
        if not isinstance(rec, dict):
            bad = "is not an object"
        elif not isinstance(rec.get("command"), str):
            bad = "has no 'command' string"
        elif not (isinstance(rec.get("lengths"), list) and all(isinstance(n, int) for n in rec["lengths"])):
            bad = "has no 'lengths' list of integers"
        elif not isinstance(rec.get("bytes_at"), int):
            bad = "has no integer 'bytes_at'"
        elif not isinstance(rec.get("rows"), list) or not all(
            isinstance(r, dict) and isinstance(r.get("method"), str) and isinstance(r.get("kv_quant"), str)
            and isinstance(r.get("bytes_per_token"), (int, float)) and isinstance(r.get("headline"), dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in r["headline"].items())
            for r in rec["rows"]
        ):
            bad = "has rows without method, kv_quant, bytes_per_token and headline"
        if bad:
            raise MaskError(f"{where}: kv_quant record {i} {bad}; fix or delete the file")
    return records


def build_card(
    mask: ChannelMask,
    repo: str,
    eval_results: list[dict[str, Any]] | None = None,
    figures: dict[str, str] | None = None,
    kv_quant: dict[str, Any] | list[dict[str, Any]] | None = None,
):
    """A huggingface_hub ModelCard for ``mask``; ``eval_results`` items have task/dataset/metric/value keys,
    and optionally the other fields of ``huggingface_hub.EvalResult`` (dataset_config, dataset_args,
    metric_config, metric_args: e.g. the context length and the method of one result).

    ``figures`` maps a PNG file of the repo to the command that drew it; ``kv_quant`` is the record of
    :func:`kv_quant_section` (the mask evaluated with a quantised middle), or a list of them (one per run).
    """
    import torch
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    dtype = torch.bfloat16
    s = mask.stats(dtype=dtype)
    fam = family_of(mask.base_model)
    tags = ["leank", "kv-cache", "pruning"] + ([fam] if fam else [])
    results_md = ""
    model_index: list[EvalResult] | None = None
    if eval_results:
        model_index = [
            EvalResult(
                task_type=r.get("task_type", "text-generation"),
                task_name=r.get("task", "retrieval"),
                dataset_type=r.get("dataset_type", "synthetic"),
                dataset_name=r["dataset"],
                metric_type=r.get("metric_type", "accuracy"),
                metric_name=r.get("metric", "accuracy"),
                metric_value=r["value"],
                **{k: r[k] for k in _EVAL_EXTRAS if r.get(k) is not None},
            )
            for r in hub_rows(eval_results)
        ]
        # rows of several runs (e.g. one per context length): each run's table under the command that measured it
        commands = list(dict.fromkeys(r.get("command", "leank eval " + repo) for r in eval_results))
        quants = sorted({str((r.get("metric_args") or {}).get("kv_quant") or "none") for r in eval_results})
        said = ("The LeanK rows decode with the middle in the model's dtype (kv_quant: none)." if quants == ["none"]
                else f"kv_quant of the LeanK rows: {', '.join(quants)}.")
        rules = sorted({str(r["metric_args"]["rule"]) for r in eval_results if (r.get("metric_args") or {}).get("rule")})
        if rules:
            said += f" Rule of the LeanK rows: {', '.join(rules)}" + (
                " (every query, the prompt's too, pruned by its position: the vLLM plugin's leank_rule positional)."
                if rules == ["positional"] else " (measured under the retired dense-prefill rule: the prompt attended "
                "densely and pruned decoding followed a schedule anchored at its end; the rows stand for dense-prompt, "
                "the default, which gave the same answers on the measured probes: docs/rule.md, The retired rule)."
                if rules == ["dense-prefill"] else " (the prompt attended densely, each generated token pruned by its "
                "position: what the vLLM plugin serves)." if rules == ["dense-prompt"] else ".")
        results_md = f"## Results\n\n{said}\n\n" + results_section(eval_results, "leank eval " + repo, commands)
    results_md += kv_quant_section(kv_quant)
    data = ModelCardData(
        base_model=mask.base_model,
        library_name="leank",
        tags=tags,
        pipeline_tag="text-generation",
        license=((mask.extra or {}).get("provenance") or {}).get("license", "").lower()
        or KNOWN_LICENSES.get(mask.base_model or ""),
        model_name=f"leank-{(mask.base_model or 'model').split('/')[-1].lower()}",
        eval_results=model_index,
    )
    b = s["bytes_per_token"]
    bytes_ratio = b["leank"] / b["dense"]
    runs = {c: i for i, c in enumerate(dict.fromkeys(r.get("command", "leank eval " + repo)
                                                     for r in eval_results or []), 1)}
    kv_runs = {rec["command"]: " and ".join(f"{n:,} tokens" for n in rec["lengths"])
               for rec in ([kv_quant] if isinstance(kv_quant, dict) else kv_quant or [])}
    text = CARD_TEMPLATE.format(
        card_data=f"---\n{data.to_yaml()}\n---\n",
        base_model=mask.base_model or "its base model",
        headline=headline_line(eval_results or [], bytes_ratio) if eval_results or not provenance_section(mask)
        else f"**{bytes_ratio:.0%} of the dense KV bytes for every pruned token; imported, not evaluated here "
        "(the authors' numbers: Provenance below).**",
        purpose="A [LeanK](https://arxiv.org/abs/2508.02215) mask, static and learned, over the K channels of every "
        f"attention head, for decoding {mask.base_model or 'its base model'} with long prompts: the first {mask.sink_size} and "
        f"the last {mask.recent_size} tokens stay whole, every token between keeps {100 * s['k_kept_fraction']:.1f}% "
        f"of its K channels (and its V only in heads that keep any), so pruning starts past about "
        f"{mask.sink_size + mask.recent_size} tokens. Load it with `LeanKModel.from_pretrained` (Usage) or serve "
        "it with leank's vLLM plugin.",
        learned_on=learned_on(mask),
        k_pct=100 * s["k_kept_fraction"],
        v_pct=100 * s["v_kept_fraction"],
        zero_heads=s["zero_heads"],
        total_heads=s["total_heads"],
        dtype=b["dtype"],
        leank_bytes=b["leank"],
        dense_bytes=b["dense"],
        bytes_ratio=bytes_ratio,
        sink=mask.sink_size,
        recent=mask.recent_size,
        accumu=mask.accumu_size,
        ratio=mask.ratio,
        align=mask.align,
        stats_command=STATS_COMMAND.format(repo=repo),
        pattern_caption=_PATTERN_CAPTION.format(
            left="each K channel's stage-1 learned scaler (the mask keeps each head's highest)"
            if mask.scores is not None else "the kept (1) and pruned (0) K channels", dim=mask.keep.shape[-1]),
        usage=USAGE.format(repo=repo, sink=mask.sink_size, recent=mask.recent_size,
                           notes=max(20, (mask.sink_size + mask.recent_size) // 8)),  # ~11 tokens a note, twice
        results=results_md,
        figures=("## Figures\n\n" if figures else "")
        + "".join(figure_caption(name, cmd, runs, kv_runs) for name, cmd in (figures or {}).items()),
        capacity=capacity_section(mask, repo),
        provenance=provenance_section(mask),
        recipe=RECIPE_SECTION.format(recipe=(recipe := compact_recipe(mask.recipe or "# (no recipe recorded)")),
                                     fence=code_fence(recipe))
        if mask.recipe or not provenance_section(mask)
        else "",
    )
    return ModelCard(text)


EVAL_FILE = "eval.json"


def result_row_problem(row: dict[str, Any]) -> str | None:
    """Why an ``eval.json`` results row cannot be written into the card (None when it can): what
    :func:`build_card` and :func:`results_table` read, of the types they read it as."""
    import math

    if not isinstance(row.get("dataset"), str):
        return "has no 'dataset' string"
    value = row.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"has no finite number 'value' (got {value!r:.40})"
    for key in ("metric", "command", "text", "task", "task_type", "dataset_type", "metric_type", "dataset_config",
                "dataset_split", "metric_config"):
        if row.get(key) is not None and not isinstance(row[key], str):
            return f"has a {key!r} that is not a string"
    for key in ("metric_args", "dataset_args"):
        if row.get(key) is not None and not isinstance(row[key], dict):
            return f"has a {key!r} that is not an object"
    return None


def read_eval_record(folder: str | Path) -> dict[str, Any]:
    """The card's record (``eval.json``: ``results`` rows and ``figures``) of mask folder ``folder``, {} when it has
    none; a damaged one is a MaskError naming it (it would otherwise fail the card update after a whole run)."""
    from ..mask import MaskError
    from ..mask.folder import parse_config
    from ..mask.format import file_limit

    path = Path(folder) / EVAL_FILE
    if not path.is_file():
        return {}
    if path.stat().st_size > file_limit(EVAL_FILE):
        raise MaskError(f"{path} is {path.stat().st_size:,} bytes; at most {file_limit(EVAL_FILE):,}")
    record = parse_config(path.read_bytes(), path)
    results, figures = record.get("results"), record.get("figures", {})
    if results is not None and not (isinstance(results, list) and all(isinstance(r, dict) for r in results)):
        raise MaskError(f"{path}: 'results' must be a list of result rows (objects); fix or delete the file")
    for i, row in enumerate(results or ()):
        why = result_row_problem(row)
        if why:
            raise MaskError(f"{path}: results row {i} {why}; fix or delete the file")
    if not isinstance(figures, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in figures.items()):
        raise MaskError(f"{path}: 'figures' must map PNG file names to the commands that drew them; fix or delete it")
    if "kv_quant" in record:
        check_kv_quant_records(record["kv_quant"], str(path))
    return record


def write_card_files(
    folder: str | Path,
    eval_results: list[dict[str, Any]] | None = None,
    repo: str | None = None,
    figures: dict[str, str] | None = None,
    kv_quant: dict[str, Any] | list[dict[str, Any]] | None = None,
) -> None:
    """Write README.md, pattern.png (and eval.json) straight into ``folder``, a mask repo being built
    inside :func:`~leank_infer.mask.write_mask_folder`'s ``fill``; an existing one is updated as a
    whole by :func:`write_model_card`.

    Evaluation rows and figures are kept in the folder's ``eval.json`` so that a later call (a new
    figure, a re-run) adds to the card instead of dropping what an earlier command measured; new
    ``eval_results`` replace the old rows, new ``figures`` are merged in. A re-export starts a fresh folder.
    The plot needs matplotlib (the ``train`` extra); without it the card is written alone.
    """
    import json

    folder = Path(folder)
    mask = ChannelMask.from_dir(folder)
    record_path = folder / EVAL_FILE
    record = read_eval_record(folder)
    if eval_results is not None:
        record["results"] = eval_results
    if figures:
        record["figures"] = {**record.get("figures", {}), **figures}
    if kv_quant is not None:
        record["kv_quant"] = kv_quant
    if record:
        record_path.write_text(json.dumps(record, indent=2))
    repo = repo or str(folder)  # the card's usage snippet loads the folder by the path it was given
    try:
        plot_pattern(mask, folder / "pattern.png")
    except ImportError as e:
        warnings.warn(f"pattern.png not written ({e.name} is missing: pip install 'leank[train]')", stacklevel=2)
    card = card_text(build_card(mask, repo, record.get("results"), record.get("figures"), record.get("kv_quant")))
    from ..mask import MaskError
    from ..mask.format import file_limit

    if len(card.encode()) > file_limit("README.md"):  # a push would refuse it: say so now, with what makes it big
        raise MaskError(f"{folder}: the card would be {len(card.encode()):,} bytes, over the {file_limit('README.md'):,} "
                        f"a mask repo's README.md may hold (push refuses it); {EVAL_FILE} holds "
                        f"{len(record.get('results') or ()):,} result rows: keep fewer")
    with open(folder / "README.md", "w", newline="", encoding="utf-8") as f:
        f.write(card)


def write_model_card(
    folder: str | Path,
    eval_results: list[dict[str, Any]] | None = None,
    repo: str | None = None,
    figures: dict[str, str] | None = None,
    figure_files: Sequence[str | Path] = (),
    kv_quant: dict[str, Any] | list[dict[str, Any]] | None = None,
) -> Path:
    """Update the card (README.md, pattern.png, eval.json) of the mask repo ``folder`` as a whole.

    The folder's files, the ``figure_files`` (plots a command drew elsewhere, copied in by name) and the
    new card are written to a fresh sibling that replaces the folder in one swap
    (:func:`~leank_infer.mask.update_mask_folder`): a reader sees the old card or the new one, a
    failure leaves the folder as it was, and a save or export that lands while the card is drawn is
    kept (the card is drawn again for it). See :func:`write_card_files` for what the card keeps.
    """
    folder = Path(folder)
    ChannelMask.from_dir(folder)  # a folder that is not a mask repo: its MaskError, before anything is written
    read_eval_record(folder)  # and a damaged eval.json, before a card is drawn
    sources = [Path(f) for f in figure_files]
    repo = repo or str(folder)

    def fill(tmp: Path) -> None:
        for f in folder.iterdir():
            if f.is_file() and not f.is_symlink():
                shutil.copy2(f, tmp / f.name)
        for f in sources:
            shutil.copyfile(f, tmp / f.name)
        write_card_files(tmp, eval_results, repo, figures, kv_quant)

    return update_mask_folder(folder, fill)
