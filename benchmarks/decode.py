"""Decode benchmark of issue 4 on the CPU: dense vs LeanK at 2k/4k/8k x batch 1/4 (``leank bench``).

    python benchmarks/decode.py [MASK] [--contexts ...] [--batches ...] [--new_tokens N]
"""

import sys

from leank_infer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
