"""``leank eval``: long-context accuracy and next-token KL, full model vs LeanK vs baselines at equal K budget.

The default probes are the RULER-style suite of :mod:`leank_train.ruler` (ten tasks, reported per task, with
Wilson intervals, paired counts against the full model and a headline over the tasks the full model passes:
:mod:`leank_train.stats`). ``--kinds`` selects the older three needle kinds instead. Neither shares
wordings, haystack sentences or key words with the training data (``leank_train.data``).

Baselines at the same K budget:
- ``random``: per head the same number of kept channels as the learned mask, chosen at random;
- ``think``: query-driven channel selection at prefill (ThinK): per KV head keep the channels with
  the largest ``|Q_window| * |K|`` column-norm product, the same fraction in every head.

The loop is a Lightning ``Trainer.test`` (its progress bar, its logging), metrics are torchmetrics.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import random
import string
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torchmetrics
from torch.utils.data import DataLoader

from leank_infer import ChannelMask
from leank_infer.card import write_model_card
from leank_infer.cli_types import positive_int
from leank_infer.generation import CACHE_KWARG

from .errors import RecipeError
from .evaluation.stats import summarize
from .evaluation.tasks import TASKS, Probe, build_probes, chat_ids, correct, haystack_sentences

#: the RULER-style tasks (leank_train.ruler), all of them by default
TASK_NAMES = tuple(TASKS)
#: ``--quick``: one length, two probes per task, no KL (a smoke test: its intervals are wide)
QUICK = {"lengths": [1024], "samples": 2, "kl": False}
KINDS = ("passkey", "multikey", "multivalue")
METHODS = ("full", "leank", "random", "think")
_ANIMALS = "otter heron lynx badger falcon walrus ibis marmot gecko yak tapir okapi".split()


def make_probe(tokenizer: Any, kind: str, length: int, rng: random.Random, sentences: list[str]) -> Probe:
    """A needle prompt of about ``length`` tokens of ``kind`` (passkey / multikey / multivalue)."""
    if kind == "passkey":
        value = str(rng.randint(1_000_000, 9_999_999))
        needles = [f"The secret passcode for the vault is {value}. Keep it safe."]
        question = "What is the secret passcode for the vault? Reply with the number only."
        expected = [value]
    elif kind == "multikey":
        keys = [f"{rng.choice(_ANIMALS)}-{rng.randint(10, 99)}" for _ in range(4)]
        vals = ["".join(rng.choices(string.ascii_lowercase + string.digits, k=8)) for _ in keys]
        needles = [f"The access token of {k} is {v}." for k, v in zip(keys, vals, strict=True)]
        i = rng.randrange(len(keys))
        question = f"What is the access token of {keys[i]}? Reply with the token only."
        expected = [vals[i]]
    elif kind == "multivalue":
        animal = rng.choice(_ANIMALS)
        vals = [str(rng.randint(10_000, 99_999)) for _ in range(3)]
        needles = [f"A lucky number of the {animal} is {v}." for v in vals]
        question = f"List every lucky number of the {animal} mentioned in the text."
        expected = vals
    else:
        raise ValueError(f"unknown probe kind {kind!r}; choose from {', '.join(KINDS)}")
    intro = "Read the following documentation carefully. A few facts are hidden inside it."
    overhead = len(tokenizer.apply_chat_template(
        [{"role": "user", "content": intro + " ".join(needles) + question}], add_generation_prompt=True,
        return_dict=True)["input_ids"])
    budget = max(0, length - overhead)
    start = rng.randrange(len(sentences))
    hay: list[str] = []
    used = 0
    while used < budget:
        s = sentences[(start + len(hay)) % len(sentences)]
        used += len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
        hay.append(s)
    for needle in needles:  # depths spread over 10%..90% of the haystack
        hay.insert(int(len(hay) * rng.uniform(0.1, 0.9)), needle)
    content = f"{intro}\n\n{' '.join(hay)}\n\n{question}"
    return Probe([{"role": "user", "content": content}], expected, kind, length)


def random_mask_like(mask: ChannelMask, seed: int = 0) -> ChannelMask:
    """The same kept count per head as ``mask``, channels drawn at random."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(mask.keep.shape, generator=g)
    ranks = noise.argsort(-1).argsort(-1)
    keep = ranks < mask.kept_counts.unsqueeze(-1)
    return _with_keep(mask, keep)


def _with_keep(mask: ChannelMask, keep: torch.Tensor) -> ChannelMask:
    """``mask`` with another ``keep`` (no scores): sizes, base model, adapter, overrides and dense layers stay."""
    return replace(mask, keep=keep, scores=None)


_PROBE: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa (or, for soft-capped models such as Gemma 2, which sdpa refuses, the exact soft-capped
    attention), recording each layer's post-RoPE queries and keys (for the ThinK baseline)."""
    from leank_infer.attention import dense_attention

    _PROBE[module.layer_idx] = (query.detach(), key.detach())
    return dense_attention(module, query, key, value, attention_mask, **kwargs)


def think_mask(model: Any, input_ids: torch.Tensor, mask: ChannelMask, window: int = 32) -> ChannelMask:
    """ThinK's query-driven selection for one prompt, at the learned mask's K budget.

    The budget is the learned mask's mean kept count over the layers it prunes; layers it leaves dense
    (sliding-window layers: Gemma 2/3) stay dense here too, as LeanK's cache requires.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("leank_probe", _probe_attention)
    AttentionMaskInterface.register("leank_probe", sdpa_mask)
    previous = model.config._attn_implementation
    _PROBE.clear()
    try:
        model.set_attn_implementation("leank_probe")
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    pruned = [i for i in range(mask.num_layers) if i not in mask.dense_layers]
    missed = sorted(set(pruned) - set(_PROBE))
    if missed:  # those layers would stay whole: ThinK would spend more than LeanK's budget
        _PROBE.clear()
        raise RuntimeError(f"ThinK baseline: the probe saw no queries/keys of layers {missed}")
    per_head = int(round(float(mask.keep[pruned].float().mean()) * mask.head_dim)) if pruned else mask.head_dim
    keep = torch.ones_like(mask.keep)
    for layer, (q, k) in sorted(_PROBE.items()):
        if layer in mask.dense_layers:
            continue
        keep[layer] = False
        b, hq, _, d = q.shape
        hkv = k.shape[1]
        qn = q[:, :, -window:].float().reshape(b, hkv, hq // hkv, -1, d).pow(2).sum(dim=(0, 2, 3)).sqrt()
        kn = k.float().pow(2).sum(dim=(0, 2)).sqrt()  # column norms per KV head and channel: [Hkv, D]
        top = (qn * kn).topk(per_head, dim=-1).indices
        keep[layer].scatter_(-1, top.cpu(), True)
    _PROBE.clear()
    return _with_keep(mask, keep)


@dataclass
class EvalSettings:
    """What ``leank run`` evaluates after stage 2 (the recipe's ``evaluate:`` section)."""

    #: run the evaluation and put its table in the model card
    enabled: bool = True
    #: prompt lengths in tokens
    lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    #: probes per task and length
    samples: int = 6
    #: full model, the learned mask, and the two baselines at the same K budget
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    #: seed of the probes
    seed: int = 1234
    #: also measure the next-token KL(full || LeanK) on held-out text
    kl: bool = True
    #: the tasks of the suite (leank_train.ruler)
    tasks: list[str] = field(default_factory=lambda: list(TASK_NAMES))
    #: a smoke test instead: one length, two probes per task, no KL (``QUICK``)
    quick: bool = False

    def resolved(self) -> EvalSettings:
        """These settings with ``quick`` applied (its lengths, probes and KL replace the others)."""
        return replace(self, **QUICK) if self.quick else self

    def command(self, mask: str) -> str:
        """The ``leank eval`` command that reproduces these figures."""
        if self.quick:
            cmd = f"leank eval {mask} --quick --methods {' '.join(self.methods)} --seed {self.seed}"
        else:
            cmd = (f"leank eval {mask} --lengths {' '.join(map(str, self.lengths))} --samples {self.samples}"
                   f" --methods {' '.join(self.methods)} --seed {self.seed}")
        if list(self.tasks) != list(TASK_NAMES):
            cmd += f" --tasks {' '.join(self.tasks)}"
        return cmd if self.kl or self.quick else cmd + " --no-kl"


def card_results(results: dict[str, Any], command: str) -> list[dict[str, Any]]:
    """Evaluation results in the shape ``leank_infer.card.build_card`` puts in the model index.

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


def score_answer(text: str, expected: Sequence[str]) -> float:
    """1.0 when the answer holds every expected string (RULER's all-or-nothing match, case ignored), else 0.0."""
    return float(correct(text, expected))


def answer_with(lm: Any, method: str, inputs: dict[str, torch.Tensor], max_new_tokens: int = 24,
                random_mask: ChannelMask | None = None) -> str:
    """Greedy answer of ``method``: the full model, the learned mask, or a baseline decoding with its own mask
    (``random_mask``, default :func:`random_mask_like` of the learned one; ThinK's is chosen per prompt)."""
    from leank_infer import LeanKModel

    gen = {"max_new_tokens": max_new_tokens, "do_sample": False}
    if method == "full":
        with lm.dense():
            out = lm.model.generate(**inputs, **gen)
    elif method == "leank":
        out = lm.generate(**inputs, **gen)
    elif method in ("random", "think"):
        if method == "random":
            m = random_mask if random_mask is not None else random_mask_like(lm.mask)
        else:
            m = think_mask(lm.model, inputs["input_ids"], lm.mask)
        out = LeanKModel(lm.model, m, lm.tokenizer).generate(**inputs, **gen)
    else:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    return lm.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


class RetrievalEval(L.LightningModule):
    """Answers every probe with each method; accuracy per (method, length) as torchmetrics."""

    def __init__(self, lm: Any, methods: Sequence[str], lengths: Sequence[int], max_new_tokens: int = 24):
        super().__init__()
        self.lm = lm
        self.methods = list(methods)
        self.max_new_tokens = max_new_tokens
        self.acc = torch.nn.ModuleDict({
            f"{m}_{n}": torchmetrics.aggregation.MeanMetric() for m in self.methods for n in lengths
        })
        self.answers: list[dict[str, Any]] = []
        self._random = random_mask_like(lm.mask)

    def _answer(self, method: str, inputs: dict[str, torch.Tensor], max_new_tokens: int | None = None) -> str:
        return answer_with(self.lm, method, inputs, max_new_tokens or self.max_new_tokens, self._random)

    def test_step(self, probe: Probe, batch_idx: int) -> None:
        ids = torch.tensor([chat_ids(self.lm.tokenizer, probe.messages, probe.answer_prefix)])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        row: dict[str, Any] = {"kind": probe.kind, "length": probe.length, "tokens": int(ids.shape[1]),
                               "haystack": probe.haystack, "index": probe.index, "expected": probe.expected,
                               "correct": {}}
        for method in self.methods:
            text = self._answer(method, dict(inputs), probe.max_new_tokens)
            ok = score_answer(text, probe.expected)
            self.acc[f"{method}_{probe.length}"].update(ok)
            row[method] = text
            row["correct"][method] = bool(ok)
        self.answers.append(row)

    def on_test_epoch_end(self) -> None:
        for name, metric in self.acc.items():
            if metric.update_count:
                self.log(f"acc/{name}", metric.compute())

    def results(self) -> dict[str, dict[int, float]]:
        table: dict[str, dict[int, float]] = {m: {} for m in self.methods}
        for name, metric in self.acc.items():
            if metric.update_count:
                method, length = name.rsplit("_", 1)
                table[method][int(length)] = float(metric.compute())
        return table


@torch.no_grad()
def next_token_kl(lm: Any, sentences: list[str], context: int = 1024, steps: int = 32, windows: int = 2) -> float:
    """Mean KL(full || LeanK) of next-token distributions while teacher-forcing held-out text."""
    from transformers import DynamicCache

    tok, model = lm.tokenizer, lm.model
    ids = tok(" ".join(sentences[len(sentences) // 2:]), return_tensors="pt")["input_ids"][0]
    kls = []
    for w in range(windows):
        seq = ids[w * (context + steps):(w + 1) * (context + steps)].unsqueeze(0)
        if seq.shape[1] < context + steps:
            break
        caches = {"full": DynamicCache(config=model.config), "leank": lm.new_cache()}
        logp = {}
        for name, cache in caches.items():
            with lm.dense() if name == "full" else contextlib.nullcontext():
                out = model(input_ids=seq[:, :context], **{CACHE_KWARG: cache}, use_cache=True)
                rows = [out.logits[:, -1]]
                for t in range(context, context + steps - 1):
                    step = model(input_ids=seq[:, t:t + 1], **{CACHE_KWARG: cache}, use_cache=True)
                    rows.append(step.logits[:, -1])
            logp[name] = torch.log_softmax(torch.cat(rows).float(), -1)
        kls.append((logp["full"].exp() * (logp["full"] - logp["leank"])).sum(-1).mean())
    return float(torch.stack(kls).mean()) if kls else float("nan")


def evaluate(lm: Any, lengths: Sequence[int] = (1024, 2048), samples: int = 4, kinds: Sequence[str] = KINDS,
             methods: Sequence[str] = METHODS, seed: int = 1234, kl: bool = True,
             max_new_tokens: int = 24, sentences: list[str] | None = None,
             tasks: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the probes (and the KL) and return accuracy per method and length.

    ``tasks`` (names of :data:`leank_train.ruler.TASKS`): the suite, ``samples`` probes per task and length,
    each task with its own generation budget, and the per-task cells, paired counts and headline of
    :func:`leank_train.stats.summarize`. Without ``tasks``: the older needle ``kinds``, ``samples`` per length.
    ``sentences`` is the KL's held-out text (and the needle kinds' haystack); default: standard-library
    docstrings, see :func:`haystack_sentences`.
    """
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    max_pos = getattr(lm.model.config, "max_position_embeddings", None)
    # a suite length is the whole budget (prompt + generation, as in RULER); a needle length the prompt's
    budget = max(lengths) if tasks is not None else max(lengths) + max_new_tokens
    if max_pos and budget > max_pos:
        raise RecipeError(f"length {max(lengths)}{'' if tasks is not None else f' + {max_new_tokens} new tokens'} "
                         f"exceeds the model's {max_pos} positions")
    sentences = sentences or haystack_sentences()
    if tasks is not None:
        probes = build_probes(lm.tokenizer, tasks, lengths, samples, seed)
    else:
        rng = random.Random(seed)
        probes = [make_probe(lm.tokenizer, kinds[i % len(kinds)], n, rng, sentences)
                  for n in lengths for i in range(samples)]
    module = RetrievalEval(lm, methods, lengths, max_new_tokens)
    trainer = L.Trainer(accelerator="cpu" if lm.model.device.type == "cpu" else "auto", devices=1, logger=False,
                        enable_checkpointing=False, enable_model_summary=False)
    trainer.test(module, DataLoader(probes, batch_size=None, collate_fn=lambda p: p), verbose=False)
    out: dict[str, Any] = {"accuracy": module.results(), "samples_per_length": samples, "lengths": list(lengths),
                           "methods": list(methods), "answers": module.answers}
    if tasks is not None:
        out.update(samples_per_task=samples, **summarize(module.answers, methods, lengths, tasks))
    if kl:
        out["next_token_kl"] = next_token_kl(lm, sentences)
    return out


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


def ratio_sweep(lm: Any, masks: Sequence[tuple[str, ChannelMask]], lengths: Sequence[int] = (1024, 2048),
                samples: int = 6, kinds: Sequence[str] = KINDS, seed: int = 1234,
                sentences: list[str] | None = None, tasks: Sequence[str] | None = None) -> dict[str, Any]:
    """Accuracy and KV bytes per token of several masks of one base model, on the same probes.

    The full model is evaluated once; each mask decodes the same probes (same seed) with ``lm``'s model.
    With ``tasks`` (the suite) a mask's accuracy per length is its headline score (over the tasks the full
    model passes there), and its per-task cells and paired counts against the full model come along.
    """
    from leank_infer import LeanKModel

    sentences = sentences or haystack_sentences()
    full = evaluate(lm, lengths, samples, kinds, ["full"], seed, kl=False, sentences=sentences, tasks=tasks)
    full_acc = full["accuracy"]["full"]
    rows = []
    for name, mask in masks:
        res = evaluate(LeanKModel(lm.model, mask, lm.tokenizer), lengths, samples, kinds, ["leank"], seed,
                       kl=False, sentences=sentences, tasks=tasks)
        s = mask.stats(dtype=torch.bfloat16)
        row = {"mask": name, "ratio": mask.ratio, "k_kept": s["k_kept_fraction"], "v_kept": s["v_kept_fraction"],
               "zero_heads": s["zero_heads"], "bytes_per_token": s["bytes_per_token"],
               "accuracy": res["accuracy"]["leank"], "answers": res["answers"]}
        if tasks is not None:
            paired = [{**f, "correct": {"full": f["correct"]["full"], "leank": m["correct"]["leank"]}}
                      for f, m in zip(full["answers"], res["answers"], strict=True)]
            summary = summarize(paired, ["full", "leank"], lengths, tasks)
            heads = summary["headline"]
            row.update(summary)
            row["accuracy"] = {n: heads[n]["leank"]["score"] if "leank" in heads[n] else float("nan")
                               for n in lengths}
            full_acc = {n: heads[n]["full"]["score"] if "full" in heads[n] else float("nan") for n in lengths}
        rows.append(row)
    return {"full": full_acc, "masks": rows, "lengths": list(lengths), "samples_per_length": samples,
            **({"tasks": list(tasks), "full_answers": full["answers"]} if tasks is not None else {})}


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
                     f"{b['leank']:,} ({b['ratio']:.2f}x) | " + " | ".join(f"{r['accuracy'][n]:.2f}" for n in lengths)
                     + " |")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="leank eval", description="Retrieval accuracy full vs LeanK vs baselines.")
    p.add_argument("mask", nargs="+",
                   help="mask repo folder or Hub id; several masks of one base model = a ratio sweep (LeanK only)")
    p.add_argument("--revision", default=None)
    p.add_argument("--lengths", type=positive_int, nargs="+", default=[1024, 2048])
    p.add_argument("--samples", type=positive_int, default=6,
                   help="probes per task and length (with --kinds: per length, the kinds alternate)")
    p.add_argument("--tasks", nargs="+", default=list(TASK_NAMES), choices=TASK_NAMES, metavar="TASK",
                   help=f"tasks of the suite (default: all of {', '.join(TASK_NAMES)})")
    p.add_argument("--kinds", nargs="+", default=None, choices=KINDS,
                   help="the older needle probes instead of the suite")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke test: {QUICK['lengths']} tokens, {QUICK['samples']} probes per task, no KL "
                        "(overrides --lengths, --samples and the KL)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-kl", action="store_true", help="skip the next-token KL measurement")
    p.add_argument("--json", type=Path, default=None, help="write results (with every answer) to this file")
    p.add_argument("--plot", type=Path, default=None,
                   help="draw the results to this PNG: accuracy vs length, or accuracy and bytes vs ratio for a sweep")
    p.add_argument("--card", action="store_true",
                   help="rewrite the mask folder's model card with these results (and the plot, if drawn)")
    args = p.parse_args(argv)
    from .cli import one_line_errors

    with one_line_errors("leank eval"):
        return _main(args, argv)


def _main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from leank_infer import LeanKModel
    from leank_infer.mask import model_positions
    from leank_infer.plots import plot_accuracy, plot_ratio_sweep

    cmd = "leank eval " + " ".join(argv)
    if args.quick:
        args.lengths, args.samples, args.no_kl = QUICK["lengths"], QUICK["samples"], not QUICK["kl"]
    tasks = None if args.kinds else args.tasks
    kinds = args.kinds or KINDS
    lm = LeanKModel.from_pretrained(args.mask[0], revision=args.revision)
    limit = model_positions(lm.model.config)
    # a suite length is the whole budget (prompt + generation, as in RULER); a needle length the prompt's
    new = 0 if tasks is not None else inspect.signature(evaluate).parameters["max_new_tokens"].default
    if limit is not None and max(args.lengths) + new > limit:
        raise RecipeError(f"--lengths {max(args.lengths):,}{f' + {new} new tokens' if new else ''} exceeds the "
                          f"model's {limit:,} positions (max_position_embeddings); use lengths up to {limit - new:,}")
    if len(args.mask) > 1:
        masks = [(args.mask[0], lm.mask)]
        for path in args.mask[1:]:
            mask = ChannelMask.from_pretrained(path, revision=args.revision)
            model_of = lambda m: (m.base_model, m.adapter, m.adapter_revision, m.config_overrides)  # noqa: E731
            if model_of(mask) != model_of(lm.mask):
                raise SystemExit(f"leank eval: a sweep needs one base model, adapter and config overrides; "
                                 f"{path} is for {mask.base_model!r} "
                                 f"(adapter {mask.adapter!r}, overrides {mask.config_overrides}), {args.mask[0]} "
                                 f"for {lm.mask.base_model!r} (adapter {lm.mask.adapter!r}, "
                                 f"overrides {lm.mask.config_overrides})")
            mask.validate(lm.model.config)
            masks.append((path, mask))
        res = ratio_sweep(lm, masks, args.lengths, args.samples, kinds, args.seed, tasks=tasks)
        table = format_sweep(res)
        if args.plot:
            plot_ratio_sweep(res, args.plot, cmd)
    else:
        res = evaluate(lm, args.lengths, args.samples, kinds, args.methods, args.seed, kl=not args.no_kl, tasks=tasks)
        table = format_table(res)
        if args.plot:
            plot_accuracy(res, args.plot, cmd)
        if args.card:
            figures = {args.plot.name: cmd} if args.plot else None
            write_model_card(args.mask[0], card_results(res, cmd), figures=figures)
    if args.card and len(args.mask) > 1:
        from leank_infer.card import EVAL_FILE

        for path, row in zip(args.mask, res["masks"], strict=True):
            figures = {args.plot.name: cmd} if args.plot else {}
            # a card keeps the rows it has (e.g. a single-mask eval with baselines); one without gets the sweep's
            rows = None
            if not (Path(path) / EVAL_FILE).is_file() or "results" not in json.loads((Path(path) / EVAL_FILE).read_text()):
                rows = card_results({"accuracy": {"full": res["full"], "leank": row["accuracy"]}}, cmd)
                if "tasks" in row:
                    rows = card_results({**row, "methods": ["full", "leank"]}, cmd)
            write_model_card(path, rows, figures=figures)
    if args.card and args.plot:
        import shutil

        for path in args.mask:
            target = Path(path) / args.plot.name
            if Path(path).is_dir() and target.resolve() != args.plot.resolve():
                shutil.copyfile(args.plot, target)
    print(f"\n`{cmd}`\n")
    print(table)
    if args.json:
        args.json.write_text(json.dumps({"command": cmd, **res}, indent=2))
    return 0
