"""Next-token KL(full || LeanK) while teacher-forcing held-out text: a loss that accuracy can hide."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from leank_infer.model.generation import CACHE_KWARG


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
