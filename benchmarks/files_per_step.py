"""How many of the repo's files one decode step and one training step pass through (a newcomer reads them).

Counts the distinct files of leank_infer / leank_train whose code runs (``sys.settrace``) during: a
``generate`` (new cache, prefill, one decode step), one decode forward over a prefilled LeanK cache, and
one ``training_step`` + backward, on the tiny random Llama of tests/conftest.py (CPU, seconds).

    PYTHONPATH=$PWD python benchmarks/files_per_step.py

It also runs on a checkout from before the concept folders (it falls back to ``leank_train.module``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable

os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402

ROOT = os.getcwd()
sys.path.insert(0, os.path.join(ROOT, "tests"))


def trace(fn: Callable[[], object]) -> list[str]:
    """The files of leank_infer / leank_train in which a function is called while ``fn`` runs."""
    files: set[str] = set()

    def tracer(frame, event, arg):  # noqa: ANN001 (sys.settrace's signature)
        f = frame.f_code.co_filename
        if f.startswith(os.path.join(ROOT, "leank_")):
            files.add(os.path.relpath(f, ROOT))
        return None

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return sorted(files)


def show(title: str, files: list[str]) -> None:
    print(f"{title}: {len(files)}")
    for f in files:
        print("  ", f)


def main() -> None:
    from conftest import tiny_model

    from leank_infer import ChannelMask, LeanKModel

    if os.path.isdir(os.path.join(ROOT, "leank_train", "distill")):
        from leank_train.distill.module import LeanKDistillation
    else:  # a checkout from before the concept folders
        from leank_train.module import LeanKDistillation

    torch.manual_seed(0)
    mask = ChannelMask.from_scores(torch.rand(2, 2, 16), ratio=0.5, align=4, sink_size=4, recent_size=8,
                                   accumu_size=4)
    with tempfile.TemporaryDirectory() as d:
        mask.save_pretrained(d)
        lm = LeanKModel.from_pretrained(d, model=tiny_model("llama"), check_base_model=False)
    ids = torch.randint(3, 128, (1, 40))
    lm.generate(input_ids=ids, max_new_tokens=2, do_sample=False)  # warm: imports, first prefill
    show("generate (new cache, prefill, 1 decode step)",
         trace(lambda: lm.generate(input_ids=ids, max_new_tokens=2, do_sample=False)))
    cache = lm.new_cache()
    with torch.no_grad():
        lm(input_ids=ids, cache=cache, use_cache=True)
        lm(input_ids=ids[:, :1], cache=cache, use_cache=True)  # warm the decode path
        step = trace(lambda: lm(input_ids=ids[:, :1], cache=cache, use_cache=True))
    show("one decode step (forward of 1 token over a prefilled LeanK cache)", step)

    module = LeanKDistillation.for_model(tiny_model("llama"), sink_size=4, recent_size=8, align=4)
    total, context = 60, 50
    batch = {"input_ids": torch.randint(3, 128, (1, total)),
             "labels": torch.where(torch.arange(total) >= context, torch.randint(3, 128, (1, total)), -100),
             "context_len": torch.tensor([context])}
    module.training_step(batch, 0)
    show("training_step (+backward)", trace(lambda: module.training_step(batch, 0).backward()))


if __name__ == "__main__":
    main()
