"""``leank eval``: retrieval accuracy and next-token KL, full model vs LeanK vs baselines at equal K budget.

The prompts here deliberately share nothing with the training data (``leank_train.data``): other
wordings (passkeys, access tokens, lucky numbers instead of "special magic" uuids/numbers) and another
haystack (docstrings of the Python standard library instead of ``pydoc_data`` topics or noise).

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

KINDS = ("passkey", "multikey", "multivalue")
METHODS = ("full", "leank", "random", "think")
_HAYSTACK_MODULES = (
    "collections", "functools", "itertools", "json", "argparse", "logging", "subprocess", "threading",
    "unittest", "csv", "textwrap", "inspect", "typing", "pathlib", "random", "statistics", "decimal",
    "fractions", "datetime", "calendar", "heapq", "bisect", "shutil", "tempfile", "zipfile", "tarfile",
    "sqlite3", "socket", "selectors", "asyncio", "contextlib", "dataclasses", "enum", "string", "difflib",
)
_ANIMALS = "otter heron lynx badger falcon walrus ibis marmot gecko yak tapir okapi".split()


def haystack_sentences() -> list[str]:
    """Sentences from standard-library docstrings: English prose that training never sees."""
    import importlib

    seen, sentences = set(), []
    for name in _HAYSTACK_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        objs = [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
        for obj in objs:
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            for para in (doc or "").split("\n\n"):
                line = " ".join(para.split())
                if len(line) < 40 or ">>>" in line or line in seen or not line[0].isalpha():
                    continue
                seen.add(line)
                sentences.append(line)
    return sentences


@dataclass
class Probe:
    """One retrieval prompt: chat messages, the strings a correct answer contains, its length bucket."""

    messages: list[dict[str, str]]
    expected: list[str]
    kind: str
    length: int


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
    #: probes per length (the kinds alternate)
    samples: int = 6
    #: full model, the learned mask, and the two baselines at the same K budget
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    #: seed of the probes
    seed: int = 1234
    #: also measure the next-token KL(full || LeanK) on held-out text
    kl: bool = True

    def command(self, mask: str) -> str:
        """The ``leank eval`` command that reproduces these figures."""
        cmd = (f"leank eval {mask} --lengths {' '.join(map(str, self.lengths))} --samples {self.samples}"
               f" --methods {' '.join(self.methods)} --seed {self.seed}")
        return cmd if self.kl else cmd + " --no-kl"


def card_results(results: dict[str, Any], command: str) -> list[dict[str, Any]]:
    """Evaluation results in the shape ``leank_infer.card.build_card`` puts in the model index."""
    rows = []
    for method, by_length in results["accuracy"].items():
        for length, value in sorted(by_length.items()):
            rows.append({"dataset": f"unseen needles, {length} tokens", "metric": f"accuracy ({method})",
                         "value": value, "command": command})
    if "next_token_kl" in results:
        rows.append({"dataset": "held-out stdlib docstrings, 1024 + 32 tokens", "metric": "next-token KL (nats)",
                     "metric_type": "kl_divergence", "value": results["next_token_kl"], "command": command})
    return rows


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

    def _answer(self, method: str, inputs: dict[str, torch.Tensor]) -> str:
        from leank_infer import LeanKModel

        lm = self.lm
        gen = {"max_new_tokens": self.max_new_tokens, "do_sample": False}
        if method == "full":
            with lm.dense():
                out = lm.model.generate(**inputs, **gen)
        elif method == "leank":
            out = lm.generate(**inputs, **gen)
        else:
            m = self._random if method == "random" else think_mask(lm.model, inputs["input_ids"], lm.mask)
            out = LeanKModel(lm.model, m, lm.tokenizer).generate(**inputs, **gen)
        return lm.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    def test_step(self, probe: Probe, batch_idx: int) -> None:
        tok = self.lm.tokenizer
        inputs = tok.apply_chat_template(probe.messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)
        row = {"kind": probe.kind, "length": probe.length, "tokens": int(inputs["input_ids"].shape[1]),
               "expected": probe.expected}
        for method in self.methods:
            text = self._answer(method, dict(inputs))
            ok = float(all(e in text for e in probe.expected))
            self.acc[f"{method}_{probe.length}"].update(ok)
            row[method] = text
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
             max_new_tokens: int = 24, sentences: list[str] | None = None) -> dict[str, Any]:
    """Run the retrieval probes (and the KL) and return accuracy per method and length.

    ``sentences`` is the haystack (default: standard-library docstrings, see :func:`haystack_sentences`).
    """
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    max_pos = getattr(lm.model.config, "max_position_embeddings", None)
    if max_pos and max(lengths) + max_new_tokens > max_pos:
        raise ValueError(f"length {max(lengths)} + {max_new_tokens} new tokens exceeds the model's {max_pos} positions")
    sentences = sentences or haystack_sentences()
    rng = random.Random(seed)
    probes = [make_probe(lm.tokenizer, kinds[i % len(kinds)], n, rng, sentences)
              for n in lengths for i in range(samples)]
    module = RetrievalEval(lm, methods, lengths, max_new_tokens)
    trainer = L.Trainer(accelerator="cpu" if lm.model.device.type == "cpu" else "auto", devices=1, logger=False,
                        enable_checkpointing=False, enable_model_summary=False)
    trainer.test(module, DataLoader(probes, batch_size=None, collate_fn=lambda p: p), verbose=False)
    out: dict[str, Any] = {"accuracy": module.results(), "samples_per_length": samples, "lengths": list(lengths),
                           "answers": module.answers}
    if kl:
        out["next_token_kl"] = next_token_kl(lm, sentences)
    return out


def format_table(results: dict[str, Any]) -> str:
    acc = results["accuracy"]
    lengths = results["lengths"]
    head = "| method | " + " | ".join(f"{n} tok" for n in lengths) + " |"
    sep = "|---|" + "---|" * len(lengths)
    rows = [f"| {m} | " + " | ".join(f"{acc[m].get(n, float('nan')):.2f}" for n in lengths) + " |" for m in acc]
    lines = [head, sep, *rows]
    if "next_token_kl" in results:
        lines.append(f"\nmean next-token KL(full || LeanK): {results['next_token_kl']:.4f} nats")
    return "\n".join(lines)


def ratio_sweep(lm: Any, masks: Sequence[tuple[str, ChannelMask]], lengths: Sequence[int] = (1024, 2048),
                samples: int = 6, kinds: Sequence[str] = KINDS, seed: int = 1234,
                sentences: list[str] | None = None) -> dict[str, Any]:
    """Accuracy and KV bytes per token of several masks of one base model, on the same probes.

    The full model is evaluated once; each mask decodes the same probes (same seed) with ``lm``'s model.
    """
    from leank_infer import LeanKModel

    sentences = sentences or haystack_sentences()
    full = evaluate(lm, lengths, samples, kinds, ["full"], seed, kl=False, sentences=sentences)
    rows = []
    for name, mask in masks:
        res = evaluate(LeanKModel(lm.model, mask, lm.tokenizer), lengths, samples, kinds, ["leank"], seed,
                       kl=False, sentences=sentences)
        s = mask.stats(dtype=torch.bfloat16)
        rows.append({"mask": name, "ratio": mask.ratio, "k_kept": s["k_kept_fraction"], "v_kept": s["v_kept_fraction"],
                     "zero_heads": s["zero_heads"], "bytes_per_token": s["bytes_per_token"],
                     "accuracy": res["accuracy"]["leank"], "answers": res["answers"]})
    return {"full": full["accuracy"]["full"], "masks": rows, "lengths": list(lengths), "samples_per_length": samples}


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
    p.add_argument("--samples", type=positive_int, default=6, help="probes per length (kinds alternate)")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
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
    lm = LeanKModel.from_pretrained(args.mask[0], revision=args.revision)
    limit = model_positions(lm.model.config)
    new = inspect.signature(evaluate).parameters["max_new_tokens"].default
    if limit is not None and max(args.lengths) + new > limit:
        raise RecipeError(f"--lengths {max(args.lengths):,} + {new} new tokens exceeds the model's {limit:,} "
                          f"positions (max_position_embeddings); use lengths up to {limit - new:,}")
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
        res = ratio_sweep(lm, masks, args.lengths, args.samples, args.kinds, args.seed)
        table = format_sweep(res)
        if args.plot:
            plot_ratio_sweep(res, args.plot, cmd)
    else:
        res = evaluate(lm, args.lengths, args.samples, args.kinds, args.methods, args.seed, kl=not args.no_kl)
        table = format_table(res)
        if args.plot:
            plot_accuracy(res, args.plot, cmd)
        if args.card:
            settings = EvalSettings(True, args.lengths, args.samples, args.methods, args.seed, not args.no_kl)
            figures = {args.plot.name: cmd} if args.plot else None
            write_model_card(args.mask[0], card_results(res, settings.command(args.mask[0])), figures=figures)
    if args.card and len(args.mask) > 1:
        from leank_infer.card import EVAL_FILE

        for path, row in zip(args.mask, res["masks"], strict=True):
            figures = {args.plot.name: cmd} if args.plot else {}
            # a card keeps the rows it has (e.g. a single-mask eval with baselines); one without gets the sweep's
            rows = None
            if not (Path(path) / EVAL_FILE).is_file() or "results" not in json.loads((Path(path) / EVAL_FILE).read_text()):
                rows = card_results({"accuracy": {"full": res["full"], "leank": row["accuracy"]}}, cmd)
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
