"""The full model alone on variants of the suite's tasks (how many distractors, values, hops, ...): what the
task defaults in ``leank_train.evaluation.tasks`` were chosen from, on a development seed (7), never on the
report seed (1234). A variant is ``task:param=value`` and answers under the name ``task[param=value]``.

    python benchmarks/task_difficulty.py niah_multikey:distractors=1 niah_multivalue:values=2 \
        variable_tracking:hops=1 common_words:top=3 frequent_words:alpha=3 --lengths 1024 --samples 8 --seed 7
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from leank_infer import LeanKModel
from leank_train.errors import RecipeError
from leank_train.evaluation.loop import evaluate
from leank_train.evaluation.methods import Full
from leank_train.evaluation.tasks import task_variant


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("variants", nargs="+")
    p.add_argument("--mask", default="hub/smollm2-135m-instruct", help="any mask of the base model (unused)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    try:
        names = [task_variant(v) for v in args.variants]
    except RecipeError as e:
        raise SystemExit(str(e)) from None
    lm = LeanKModel.from_pretrained(args.mask)
    start = time.perf_counter()
    res = evaluate(lm, args.lengths, args.samples, methods=[Full()], seed=args.seed, kl=False, tasks=names)
    took = time.perf_counter() - start
    print("| task | " + " | ".join(f"{n} tok" for n in args.lengths) + " |")
    print("|---|" + "---|" * len(args.lengths))
    for name in names:
        cells = res["tasks"][name]["full"]
        print(f"| {name} | " + " | ".join(f"{cells[n]['correct']}/{cells[n]['n']}" for n in args.lengths) + " |")
    print(f"\n{len(res['answers'])} probes, full model, {took / 60:.1f} min wall, seed {args.seed}")
    if args.json:
        args.json.write_text(json.dumps({"seconds": took, **res}, indent=1, default=str))


if __name__ == "__main__":
    main()
