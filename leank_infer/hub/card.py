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
---
{card_data}
---

# LeanK mask for {base_model}

A [LeanK](https://arxiv.org/abs/2508.02215) key-channel mask: a static, learned mask over the K
channels of every attention head. Decoding with it keeps {k_pct:.1f}% of the K cache and
{v_pct:.1f}% of the V cache for tokens outside the sink and recent windows, with full attention everywhere else.

{learned_on}## Mask statistics

| | value |
|---|---|
| K channels kept | {k_pct:.1f}% |
| V kept (heads with >= 1 channel) | {v_pct:.1f}% |
| heads with zero channels | {zero_heads} of {total_heads} |
| KV bytes / pruned token ({dtype}) | {leank_bytes:,} vs {dense_bytes:,} dense ({bytes_ratio:.3f}x) |
| sink / recent / accumulation tokens | {sink} / {recent} / {accumu} |
| ratio / align | {ratio} / {align} |

Figures from `python -c "from leank_infer import ChannelMask; print(ChannelMask.from_pretrained('{repo}').stats())"`.

![Kept channels per layer and head](pattern.png)

## Usage

```python
{usage}
```

{capacity}{results}{figures}{provenance}{recipe}"""

RECIPE_SECTION = """\
## Recipe

This mask was produced by `leank run` with this recipe:

{fence}yaml
{recipe}
{fence}
"""


def code_fence(text: str) -> str:
    """A Markdown code fence ``text`` cannot close: longer than any run of backticks in it (CommonMark), so a
    recipe's text stays inside its block and cannot add Markdown (links, images, HTML) to the card."""
    import re

    return "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))

USAGE = """\
from leank_infer import LeanKModel

m = LeanKModel.from_pretrained("{repo}")
messages = [{{"role": "user", "content": "What is the capital of France?"}}]
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
    """Save the picture the paper uses: stage-1 scores (or kept channels) per layer x head x channel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = mask.scores if mask.scores is not None else mask.keep.float()
    layers, heads, dim = values.shape
    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(12, max(3.0, layers * 0.18)), gridspec_kw={"width_ratios": [4, 1]}
    )
    im = ax1.imshow(values.reshape(layers, heads * dim).numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1,
                    interpolation="nearest")
    for h in range(1, heads):
        ax1.axvline(h * dim - 0.5, color="white", linewidth=0.6)
    ax1.set_xlabel(f"KV head x channel ({heads} heads x {dim})")
    ax1.set_ylabel("layer")
    ax1.set_title("learned channel scalers" if mask.scores is not None else "kept channels")
    fig.colorbar(im, ax=ax1, fraction=0.03)
    counts = mask.kept_counts.numpy()
    im2 = ax2.imshow(counts, aspect="auto", cmap="magma", vmin=0, vmax=dim, interpolation="nearest")
    ax2.set_xlabel("KV head")
    ax2.set_title("kept channels")
    fig.colorbar(im2, ax=ax2, fraction=0.08)
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


def results_table(eval_results: list[dict[str, Any]]) -> str:
    """A markdown table: one row per dataset (e.g. task x context length), one column per metric (e.g.
    method); a row's ``text`` (interval, paired counts) is shown instead of its bare value when given."""
    datasets = list(dict.fromkeys(r["dataset"] for r in eval_results))
    metrics = list(dict.fromkeys(r.get("metric", "accuracy") for r in eval_results))
    cell = {(r.get("metric", "accuracy"), r["dataset"]): r.get("text") or f"{r['value']:.3f}" for r in eval_results}
    lines = ["| dataset | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    lines += [f"| {d} | " + " | ".join(cell.get((m, d), "") for m in metrics) + " |" for d in datasets]
    return "\n".join(lines)


_EVAL_EXTRAS = ("dataset_config", "dataset_split", "dataset_args", "metric_config", "metric_args")


def kv_quant_section(record: dict[str, Any] | list[dict[str, Any]] | None) -> str:
    """The card's "KV quantisation" section: the runs that measured the mask with its middle quantised
    (``kv_quant``, a decode setting: the mask is the same), each method's bytes per token next to its headline;
    one table per run (a run per length, say), each under the command that measured it."""
    records = [record] if isinstance(record, dict) else list(record or [])
    if not records:
        return ""
    out = [
        "## KV quantisation\n\nThe mask is unchanged; `kv_quant=\"int8\"` or `\"int4\"` (`LeanKModel.from_pretrained(mask, "
        "kv_quant=...)`, `--kv-quant`) stores the middle's kept K channels and its V quantised (K per channel, V per "
        "token; sink and recent tokens in full precision). The rows say which quantisation each method decoded with "
        "(`QuantizedCache`: transformers' cache, every channel quantised):\n\n"
    ]
    for rec in records:
        lengths = rec["lengths"]
        lines = [f"| method | kv_quant | KV bytes/token at {rec['bytes_at']:,} (bf16) | "
                 + " | ".join(f"headline, {n} tokens" for n in lengths) + " |", "|---|---|---|" + "---|" * len(lengths)]
        for r in rec["rows"]:
            cells = [r["headline"].get(str(n), "n/a") for n in lengths]
            lines.append(f"| {r['method']} | {r['kv_quant']} | {r['bytes_per_token']:,.0f} | " + " | ".join(cells) + " |")
        probes = rec.get("samples_per_task")
        size = "" if probes is None else (
            f"{probes} probes per task and length; the headline is the mean over the tasks the full model passes ("
            + "; ".join(f"{n} tokens: {', '.join(t)}" for n, t in rec.get("headline_tasks", {}).items())
            + "), +/- its standard error.\n\n")
        out.append(f"`{rec['command']}`\n\n" + "\n".join(lines) + "\n\n" + size)
    return "".join(out)


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
            for r in eval_results
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
        results_md = f"## Results\n\n{said}\n\n" + "".join(
            f"`{cmd}`\n\n{results_table([r for r in eval_results if r.get('command', 'leank eval ' + repo) == cmd])}\n\n"
            for cmd in commands)
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
    text = CARD_TEMPLATE.format(
        card_data=data.to_yaml(),
        base_model=mask.base_model or "its base model",
        learned_on=learned_on(mask),
        k_pct=100 * s["k_kept_fraction"],
        v_pct=100 * s["v_kept_fraction"],
        zero_heads=s["zero_heads"],
        total_heads=s["total_heads"],
        dtype=s["bytes_per_token"]["dtype"],
        leank_bytes=s["bytes_per_token"]["leank"],
        dense_bytes=s["bytes_per_token"]["dense"],
        bytes_ratio=s["bytes_per_token"]["ratio"],
        sink=mask.sink_size,
        recent=mask.recent_size,
        accumu=mask.accumu_size,
        ratio=mask.ratio,
        align=mask.align,
        repo=repo,
        usage=USAGE.format(repo=repo),
        results=results_md,
        figures="".join(f"![{name}]({name})\n\nDrawn by `{cmd}`\n\n" for name, cmd in (figures or {}).items()),
        capacity=capacity_section(mask, repo),
        provenance=provenance_section(mask),
        recipe=RECIPE_SECTION.format(recipe=(recipe := (mask.recipe or "# (no recipe recorded)").rstrip()),
                                     fence=code_fence(recipe))
        if mask.recipe or not provenance_section(mask)
        else "",
    )
    return ModelCard(text)


EVAL_FILE = "eval.json"


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
    build_card(mask, repo, record.get("results"), record.get("figures"), record.get("kv_quant")).save(folder / "README.md")


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
