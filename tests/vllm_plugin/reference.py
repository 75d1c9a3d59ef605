"""Greedy tokens of ``LeanKModel.generate`` under a rule the vLLM plugin serves, in the main environment.

The vLLM environment pins transformers <5.20, where ``generate()`` does not take ``cache=``
(docs/architecture.md, "Known pitfalls"); the reference therefore runs in the project's main environment:
``python tests/vllm_plugin/reference.py`` reads ``{"model", "mask", "prompts", "max_new_tokens", "rule"}`` as JSON
on stdin and prints ``{"tokens": [[...], ...]}``, each prompt (token ids) generated alone.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from leank_infer import LeanKModel


def main() -> None:
    job = json.load(sys.stdin)
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    m = LeanKModel.from_pretrained(job["mask"], model=model, rule=job["rule"])
    tokens = []
    for ids in job["prompts"]:
        x = torch.tensor([ids])
        out = m.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=job["max_new_tokens"],
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        tokens.append(out[0, x.shape[1] :].tolist())
    print(json.dumps({"tokens": tokens}))


if __name__ == "__main__":
    main()
