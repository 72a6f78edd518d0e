"""Qwen2.5-0.5B-Instruct GSM8K GRPO recipe: `python scripts/run_qwen2_5_0_5b.py {prepare,train,full-train} [--dry-run] [--help]`.

The recipe is data in miles/recipes/library/qwen2_5_0_5b.py. On a ROCm machine this script runs the
ROCm form (the recipe plus its declared overlay), the same one scripts/amd/run_qwen2_5_0_5b.py runs.
"""

import sys

from miles.recipes.script import main

if __name__ == "__main__":
    sys.exit(main("qwen2_5_0_5b"))
