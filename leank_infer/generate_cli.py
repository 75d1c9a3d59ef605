"""``leank generate MASK --prompt ...``: one prompt answered dense and with LeanK, side by side.

Both runs use the same loaded model: the dense one inside ``LeanKModel.dense()`` (the model's own
attention), so the dense answer comes from transformers' own DynamicCache path; for a mask with
``config_overrides``, the dense answer is the base model's loaded without them (the model as published).
"""

from __future__ import annotations

import contextlib
import textwrap
import time
from typing import Literal

import torch

from .cli_types import PositiveInt, UsageError, check_text
from .decode.rule import DEFAULT_RULE, check_rule

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _side_by_side(left: tuple[str, str], right: tuple[str, str], width: int) -> str:
    col = max(20, (width - 3) // 2)
    rows = []
    cols = [[head, "-" * min(col, len(head)), *textwrap.wrap(body, col)] for head, body in (left, right)]
    for i in range(max(len(c) for c in cols)):
        a, b = (c[i] if i < len(c) else "" for c in cols)
        rows.append(f"{a:<{col}} | {b}")
    return "\n".join(rows)


def generate(
    mask: str,
    *,
    prompt: str,
    max_new_tokens: PositiveInt = 64,
    chat: bool = False,
    revision: str | None = None,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    width: PositiveInt = 100,
    rule: str = DEFAULT_RULE,
    kv_quant: Literal["int8", "int4"] | None = None,
) -> int:
    """Answer one prompt dense and with LeanK, side by side, with the KV bytes of each.

    Examples:
        leank generate hub/smollm2-135m-instruct-s3 --prompt "$(cat README.md) What does LeanK prune?" --chat
        leank generate hub/smollm2-135m-instruct-s3 --prompt "Hello" --max_new_tokens 16 --kv_quant int8

    Args:
        mask: mask folder (e.g. hub/smollm2-135m-instruct) or Hub repo id.
        prompt: the text to answer; LeanK prunes only past the mask's sink_size + recent_size tokens (the first
            line printed says both), so a shorter prompt keeps every channel.
        max_new_tokens: tokens to generate.
        chat: wrap the prompt in the tokenizer's chat template.
        revision: mask repo revision (Hub).
        dtype: dtype of the base model.
        width: total width of the side-by-side output.
        rule: the LeanK rule, dense-prompt (the default): the prompt attends with every channel, each
            generated token by its position; or positional: every query, the prompt's too, by its position alone.
        kv_quant: store LeanK's middle quantised, int8 or int4 (sink and recent tokens stay full precision).
    """
    check_text("--prompt", prompt)
    try:
        check_rule(rule)
    except ValueError as e:
        raise UsageError(f"--rule: {e}") from None
    if not prompt.strip():
        raise UsageError("--prompt is empty; give the text to answer")
    from transformers import DynamicCache

    from .decode.cache import dynamic_cache_bytes
    from .mask import model_positions
    from .model.generation import CACHE_KWARG
    from .model.leank_model import LeanKModel

    lk = LeanKModel.from_pretrained(mask, revision=revision, dtype=DTYPES[dtype], rule=rule, kv_quant=kv_quant)
    tok = lk.tokenizer
    if tok is None:
        raise UsageError("the base model has no tokenizer")
    if chat and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        enc = tok(text, return_tensors="pt", add_special_tokens=False)
    else:
        enc = tok(prompt, return_tensors="pt")
    n = enc["input_ids"].shape[1]
    limit = model_positions(lk.model.config)
    if limit is not None and n + max_new_tokens > limit:
        raise UsageError(
            f"the prompt is {n:,} tokens; with --max_new_tokens {max_new_tokens} that "
            f"exceeds the model's {limit:,} positions (max_position_embeddings): shorten the prompt"
        )
    enc = {k: v.to(lk.device) for k, v in enc.items()}
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        gen["pad_token_id"] = tok.eos_token_id

    base = None  # the dense column answers with the base model as published, not with the mask's overrides
    if lk.mask.config_overrides:
        from .model.loading import load_base_model

        base, _ = load_base_model(lk.mask.base_model, lk.mask.base_revision, lk.mask.loader, with_tokenizer=False,
                                  adapter=lk.mask.adapter, adapter_revision=lk.mask.adapter_revision,
                                  dtype=DTYPES[dtype])
        base.to(lk.device)
    results = []
    for name, cache in (("dense", DynamicCache(config=(base or lk.model).config)), ("LeanK", lk.new_cache())):
        t0 = time.perf_counter()
        with torch.inference_mode(), lk.dense() if name == "dense" and base is None else contextlib.nullcontext():
            out = (base if name == "dense" and base is not None else lk.model).generate(
                **enc, **{CACHE_KWARG: cache}, **gen)
        secs = time.perf_counter() - t0
        nbytes = cache.nbytes() if name == "LeanK" else dynamic_cache_bytes(cache)
        answer = tok.decode(out[0, n:], skip_special_tokens=True).strip()
        results.append((name, answer, nbytes, out.shape[1] - n, secs))

    s = lk.mask.stats(dtype=DTYPES[dtype])
    print(
        f"mask {mask}: K kept {s['k_kept_fraction']:.1%}, V kept {s['v_kept_fraction']:.1%}, "
        f"sink {lk.mask.sink_size} / recent {lk.mask.recent_size} / accumu {lk.mask.accumu_size}; "
        f"rule {rule}; {'middle quantised ' + kv_quant + '; ' if kv_quant else ''}prompt {n} tokens"
    )
    dense_bytes = results[0][2]
    cols = []
    for name, answer, nbytes, new, secs in results:
        ratio = f" ({nbytes / dense_bytes:.0%} of dense)" if name == "LeanK" and dense_bytes else ""
        head = f"{name}: KV {_human(nbytes)}{ratio}, {new} tokens, {secs:.1f} s"
        cols.append((head, answer or "(empty answer)"))
    print(_side_by_side(cols[0], cols[1], width))
    return 0

