"""The evaluation loop: every method answers every probe, scored; ``evaluate`` and ``ratio_sweep``.

Probes of one length are answered in batches (left padding): one dense prefill per batch (shared by every
method, :mod:`.prefill`), then each method decodes the batch with its own mask (:mod:`.methods`), rows
sharing a mask together. The loop is a Lightning ``Trainer.test`` (its progress bar, its logging),
metrics are torchmetrics.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
import torchmetrics
from torch.utils.data import DataLoader

from leank_infer import ChannelMask

from ..errors import RecipeError
from .kl import next_token_kl
from .methods import METHODS, Full, Learned, Method, RandomChannels, kv_quant_of, method, rule_of
from .needles import KINDS, make_probe
from .prefill import decode_each, prefill
from .report import renamed
from .stats import summarize
from .sweep import sweep_rows
from .tasks import Probe, build_probes, chat_ids, correct, haystack_sentences

#: prompt tokens per batch (all rows together): 16 probes of 1k tokens, 2 of 8k
BATCH_TOKENS = 16_384


def score_answer(text: str, expected: Sequence[str]) -> float:
    """1.0 when the answer holds every expected string (RULER's all-or-nothing match, case ignored), else 0.0."""
    return float(correct(text, expected))


def answer_batch(lm: Any, methods: Sequence[Method], prompts: Sequence[list[int]],
                 max_new_tokens: Sequence[int]) -> dict[str, list[str]]:
    """Greedy answers of each method to each prompt (token ids), prompt ``i`` with ``max_new_tokens[i]``.

    One dense prefill of the left-padded batch serves every method; each decodes from it with its masks (a
    method decoding by the positional rule prefills on its own: :func:`.prefill.decode`).
    """
    width = max(len(p) for p in prompts)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    device = lm.model.device
    pre = prefill(lm.model, ids.to(device), attn.to(device), window=max(m.window for m in methods))
    budget = max(max_new_tokens)
    out: dict[str, list[str]] = {}
    for m in methods:
        masks = [m.mask(lm, pre, row) for row in range(len(prompts))]
        tokens = decode_each(lm, masks, pre, budget, rule=rule_of(m, lm), kv_quant=kv_quant_of(m, lm),
                             hf_quant=m.hf_quant)
        out[m.name] = [lm.tokenizer.decode(t[:n], skip_special_tokens=True)
                       for t, n in zip(tokens, max_new_tokens, strict=True)]
    return out


def answer_with(lm: Any, method_name: str, inputs: dict[str, torch.Tensor], max_new_tokens: int = 24,
                random_mask: ChannelMask | None = None) -> str:
    """Greedy answer of one method to one prompt (``inputs["input_ids"]`` ``[1, T]``): the full model, the
    learned mask, or a baseline decoding with its own mask (``random_mask``, default
    :func:`~.methods.random_mask_like` of the learned one; ThinK's is chosen per prompt)."""
    m = RandomChannels(fixed=random_mask) if method_name == "random" and random_mask is not None else method(method_name)
    return answer_batch(lm, [m], [inputs["input_ids"][0].tolist()], [max_new_tokens])[m.name][0]


class RetrievalEval(L.LightningModule):
    """Answers every batch of probes with each method; accuracy per (method, length) as torchmetrics."""

    def __init__(self, lm: Any, methods: Sequence[str | Method], lengths: Sequence[int], max_new_tokens: int = 24):
        super().__init__()
        self.lm = lm
        self.methods = [m if isinstance(m, Method) else method(m) for m in methods]
        names = [m.name for m in self.methods]
        if len(set(names)) != len(names):
            raise ValueError(f"two methods of one evaluation share a name: {names}")
        self.max_new_tokens = max_new_tokens
        self.acc = torch.nn.ModuleDict({
            f"{m}_{n}": torchmetrics.aggregation.MeanMetric() for m in names for n in lengths
        })
        self.answers: list[dict[str, Any]] = []

    def test_step(self, probes: list[Probe], batch_idx: int) -> None:
        prompts = [chat_ids(self.lm.tokenizer, p.messages, p.answer_prefix) for p in probes]
        budgets = [p.max_new_tokens or self.max_new_tokens for p in probes]
        texts = answer_batch(self.lm, self.methods, prompts, budgets)
        for i, (probe, ids) in enumerate(zip(probes, prompts, strict=True)):
            row: dict[str, Any] = {"kind": probe.kind, "length": probe.length, "tokens": len(ids),
                                   "haystack": probe.haystack, "index": probe.index, "expected": probe.expected,
                                   "correct": {}}
            for m in self.methods:
                text = texts[m.name][i]
                ok = score_answer(text, probe.expected)
                self.acc[f"{m.name}_{probe.length}"].update(ok)
                row[m.name] = text
                row["correct"][m.name] = bool(ok)
            self.answers.append(row)

    def on_test_epoch_end(self) -> None:
        for name, metric in self.acc.items():
            if metric.update_count:
                self.log(f"acc/{name}", metric.compute())

    def results(self) -> dict[str, dict[int, float]]:
        table: dict[str, dict[int, float]] = {m.name: {} for m in self.methods}
        for name, metric in self.acc.items():
            if metric.update_count:
                m, length = name.rsplit("_", 1)
                table[m][int(length)] = float(metric.compute())
        return table


def batches(probes: Sequence[Probe], batch_tokens: int = BATCH_TOKENS) -> list[list[Probe]]:
    """Consecutive probes of one length and task, at most ``batch_tokens`` prompt tokens per batch."""
    out: list[list[Probe]] = []
    for p in probes:
        last = out[-1] if out else None
        if last and last[0].length == p.length and last[0].kind == p.kind and \
                (len(last) + 1) * p.length <= batch_tokens:
            last.append(p)
        else:
            out.append([p])
    return out


def evaluate(lm: Any, lengths: Sequence[int] = (1024, 2048), samples: int = 4, kinds: Sequence[str] = KINDS,
             methods: Sequence[str | Method] = tuple(METHODS), seed: int = 1234, kl: bool = True,
             max_new_tokens: int = 24, sentences: list[str] | None = None,
             tasks: Sequence[str] | None = None, batch_tokens: int = BATCH_TOKENS) -> dict[str, Any]:
    """Run the probes (and the KL) and return accuracy per method and length.

    ``tasks`` (names of :data:`.tasks.TASKS`): the suite, ``samples`` probes per task and length,
    each task with its own generation budget, and the per-task cells, paired counts and headline of
    :func:`.stats.summarize`. Without ``tasks``: the older needle ``kinds``, ``samples`` per length.
    ``methods``: names (:data:`.methods.METHODS`) or :class:`.methods.Method` objects (e.g. a second
    learned mask, or a baseline at its budget, answering the same probes after the same prefill).
    ``sentences`` is the KL's held-out text (and the needle kinds' haystack); default: standard-library
    docstrings, see :func:`.tasks.haystack_sentences`. ``batch_tokens`` bounds a batch's prompt tokens.
    """
    methods = [m if isinstance(m, Method) else method(m) for m in methods]
    names = [m.name for m in methods]
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
    loader = DataLoader(batches(probes, batch_tokens), batch_size=None, collate_fn=lambda b: b)
    trainer.test(module, loader, verbose=False)
    out: dict[str, Any] = {"accuracy": module.results(), "samples_per_length": samples, "lengths": list(lengths),
                           "methods": names, "answers": module.answers}
    if tasks is not None:
        out.update(samples_per_task=samples, **summarize(module.answers, names, lengths, tasks))
    if kl:
        out["next_token_kl"] = next_token_kl(lm, sentences)
    return out


def ratio_sweep(lm: Any, masks: Sequence[tuple[str, ChannelMask]], lengths: Sequence[int] = (1024, 2048),
                samples: int = 6, kinds: Sequence[str] = KINDS, seed: int = 1234,
                sentences: list[str] | None = None, tasks: Sequence[str] | None = None) -> dict[str, Any]:
    """Accuracy and KV bytes per token of several masks of one base model, on the same probes.

    One pass: each probe is prefilled once and decoded by the full model and by every mask (one
    :class:`.methods.Learned` each), so a sweep costs one prefill per probe, not one per mask.
    With ``tasks`` (the suite) a mask's accuracy per length is its headline score (over the tasks the full
    model passes there), and its per-task cells and paired counts against the full model come along.
    """
    sentences = sentences or haystack_sentences()
    learned = [Learned(f"leank-{i}", mask) for i, (_, mask) in enumerate(masks)]
    res = evaluate(lm, lengths, samples, kinds, [Full(), *learned], seed, kl=False, sentences=sentences, tasks=tasks)
    full_acc, rows = sweep_rows(res, masks, [m.name for m in learned], tasks)
    return {"full": full_acc, "masks": rows, "lengths": list(lengths), "samples_per_length": samples,
            **({"tasks": list(tasks), "full_answers": renamed(res, {"full": "full"})["answers"]} if tasks is not None else {})}
