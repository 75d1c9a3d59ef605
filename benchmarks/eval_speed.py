"""Probes per second of ``leank eval``: each method's own ``generate`` per probe vs the batched, shared prefill.

Before (the loop up to this change): every probe, every method: its own ``generate`` (a prefill of the
whole prompt, then the decode) at batch 1. After (:func:`leank_train.evaluation.loop.answer_batch`): one
dense prefill per batch of left-padded probes, shared by the four methods, each decoding the batch with
its masks. Both answer the same suite probes of the embedded SmolLM2-135M with the committed mask; the
answers are compared (they agree: the batch test in tests/test_eval_scoring.py holds them equal on a tiny
model). Times are the process's CPU time (``time.process_time``) and wall-clock time; with one torch
thread on a shared CPU the CPU time is the robust figure.

    python benchmarks/eval_speed.py [--length 1024] [--samples 4] [--tasks niah_single_number passkey]
                                    [--threads 1] [--mask hub/smollm2-135m-instruct] [--skip-before]
"""

from __future__ import annotations

import argparse
import time

import torch

from leank_infer import LeanKModel
from leank_train.evaluation.loop import answer_batch, batches
from leank_train.evaluation.methods import Full, Learned, RandomChannels, ThinK, random_mask_like, think_mask
from leank_train.evaluation.tasks import build_probes, chat_ids


def before(lm: LeanKModel, prompts: list[list[int]], budgets: list[int]) -> dict[str, list[str]]:
    """Each method's own generate, per probe, batch 1 (four prefills per probe)."""
    rnd = random_mask_like(lm.mask, 0)
    out: dict[str, list[str]] = {m: [] for m in ("full", "leank", "random", "think")}
    for p, n in zip(prompts, budgets, strict=True):
        ids = torch.tensor([p])
        gen = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": n, "do_sample": False}
        with lm.dense():
            full = lm.model.generate(**gen)
        own = {"full": full, "leank": lm.generate(**gen),
               "random": LeanKModel(lm.model, rnd, lm.tokenizer).generate(**gen),
               "think": LeanKModel(lm.model, think_mask(lm.model, ids, lm.mask), lm.tokenizer).generate(**gen)}
        for m, seq in own.items():
            out[m].append(lm.tokenizer.decode(seq[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def after(lm: LeanKModel, probes, prompts, budgets) -> dict[str, list[str]]:
    methods = [Full(), Learned(), RandomChannels(seed=0), ThinK()]
    out: dict[str, list[str]] = {m.name: [] for m in methods}
    i = 0
    for batch in batches(probes):
        part = answer_batch(lm, methods, prompts[i:i + len(batch)], budgets[i:i + len(batch)])
        for m in out:
            out[m] += part[m]
        i += len(batch)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mask", default="hub/smollm2-135m-instruct")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tasks", nargs="+", default=["niah_single_number", "passkey"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=99)
    p.add_argument("--skip-before", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lm = LeanKModel.from_pretrained(args.mask)
    probes = build_probes(lm.tokenizer, args.tasks, [args.length], args.samples, args.seed)
    prompts = [chat_ids(lm.tokenizer, q.messages, q.answer_prefix) for q in probes]
    budgets = [q.max_new_tokens or 24 for q in probes]
    runs = {"after": lambda: after(lm, probes, prompts, budgets)}
    if not args.skip_before:
        runs["before"] = lambda: before(lm, prompts, budgets)
    answers = {}
    print(f"{len(probes)} probes of {args.length} tokens ({', '.join(args.tasks)}), 4 methods, "
          f"{args.threads} torch thread(s)")
    with torch.no_grad():
        for name, fn in runs.items():
            cpu, wall = time.process_time(), time.perf_counter()
            answers[name] = fn()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            print(f"{name:6s}: {len(probes) / cpu:.3f} probes per CPU-second ({cpu:.1f} s CPU), "
                  f"{len(probes) / wall:.3f} probes/s wall ({wall:.1f} s)", flush=True)
    if "before" in answers:
        pairs = [(a, b) for m in ("full", "leank", "random", "think")
                 for a, b in zip(answers["before"][m], answers["after"][m], strict=True)]
        print(f"answers equal: {sum(a == b for a, b in pairs)}/{len(pairs)}")


if __name__ == "__main__":
    main()
