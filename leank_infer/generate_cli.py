"""``leank generate MASK --prompt ...``: one prompt answered dense and with LeanK, side by side.

Both runs use the same loaded model: the dense one inside ``LeanKModel.dense()`` (the model's own
attention), so the dense answer comes from transformers' own DynamicCache path.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import textwrap
import time
from collections.abc import Sequence

import torch

from .cli_types import positive_int, utf8_text

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leank generate", description=__doc__.split("\n")[0])
    p.add_argument("mask", help="mask folder (e.g. hub/smollm2-135m-instruct) or Hub repo id")
    p.add_argument("--prompt", required=True, type=utf8_text, help="the text to answer")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--revision", default=None, help="mask repo revision (Hub)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--width", type=positive_int, default=100, help="total width of the side-by-side output")
    return p


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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.prompt.strip():
        print("leank generate: error: --prompt is empty; give the text to answer", file=sys.stderr)
        return 2
    from transformers import DynamicCache

    from .decode.cache import dynamic_cache_bytes
    from .mask import MaskError, model_positions
    from .model.generation import CACHE_KWARG
    from .model.leank_model import LeanKModel
    from .model.loading import BaseModelError

    try:
        lk = LeanKModel.from_pretrained(args.mask, revision=args.revision, dtype=DTYPES[args.dtype])
    except (MaskError, BaseModelError) as e:
        print(f"leank generate: error: {e}", file=sys.stderr)
        return 2
    tok = lk.tokenizer
    if tok is None:
        print("leank generate: error: the base model has no tokenizer", file=sys.stderr)
        return 2
    if args.chat and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
        )
        enc = tok(text, return_tensors="pt", add_special_tokens=False)
    else:
        enc = tok(args.prompt, return_tensors="pt")
    n = enc["input_ids"].shape[1]
    limit = model_positions(lk.model.config)
    if limit is not None and n + args.max_new_tokens > limit:
        print(
            f"leank generate: error: the prompt is {n:,} tokens; with --max-new-tokens {args.max_new_tokens} that "
            f"exceeds the model's {limit:,} positions (max_position_embeddings): shorten the prompt",
            file=sys.stderr,
        )
        return 2
    enc = {k: v.to(lk.device) for k, v in enc.items()}
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        gen["pad_token_id"] = tok.eos_token_id

    results = []
    for name, cache in (("dense", DynamicCache(config=lk.model.config)), ("LeanK", lk.new_cache())):
        t0 = time.perf_counter()
        with torch.inference_mode(), lk.dense() if name == "dense" else contextlib.nullcontext():
            out = lk.model.generate(**enc, **{CACHE_KWARG: cache}, **gen)
        secs = time.perf_counter() - t0
        nbytes = cache.nbytes() if name == "LeanK" else dynamic_cache_bytes(cache)
        answer = tok.decode(out[0, n:], skip_special_tokens=True).strip()
        results.append((name, answer, nbytes, out.shape[1] - n, secs))

    s = lk.mask.stats(dtype=DTYPES[args.dtype])
    print(
        f"mask {args.mask}: K kept {s['k_kept_fraction']:.1%}, V kept {s['v_kept_fraction']:.1%}, "
        f"sink {lk.mask.sink_size} / recent {lk.mask.recent_size} / accumu {lk.mask.accumu_size}; "
        f"prompt {n} tokens"
    )
    dense_bytes = results[0][2]
    cols = []
    for name, answer, nbytes, new, secs in results:
        ratio = f" ({nbytes / dense_bytes:.0%} of dense)" if name == "LeanK" and dense_bytes else ""
        head = f"{name}: KV {_human(nbytes)}{ratio}, {new} tokens, {secs:.1f} s"
        cols.append((head, answer or "(empty answer)"))
    print(_side_by_side(cols[0], cols[1], args.width))
    return 0


if __name__ == "__main__":
    sys.exit(main())
