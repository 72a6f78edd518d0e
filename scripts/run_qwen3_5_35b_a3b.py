"""Qwen3.5-35B-A3B GRPO recipe: `python scripts/run_qwen3_5_35b_a3b.py {prepare,train,full-train} [--dry-run] [--help]`.

The recipe is data in miles/recipes/library/qwen3_5_35b_a3b.py. On a ROCm machine this script runs the
ROCm form (the recipe plus its declared overlay), the same one scripts/amd/run_qwen3_5_35b_a3b.py runs.
"""

import sys

from miles.recipes.script import main

if __name__ == "__main__":
    sys.exit(main("qwen3_5_35b_a3b"))
