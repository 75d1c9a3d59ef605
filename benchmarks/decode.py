"""Decode benchmark of issue 4 on the CPU: dense vs LeanK at 2k/4k/8k x batch 1/4 (see leank_infer/bench.py).

    python benchmarks/decode.py [MASK] [--contexts ...] [--batches ...] [--new-tokens N]
"""

import sys

from leank_infer.bench import main

if __name__ == "__main__":
    sys.exit(main(prog="python benchmarks/decode.py"))
