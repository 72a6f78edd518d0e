"""MiMo-7B-RL MTP-only training recipe: `python scripts/run_mimo_7b_rl.py {prepare,train,full-train} [--dry-run] [--help]`.

The recipe is data in miles/recipes/library/mimo_7b_rl.py. On a ROCm machine this script runs the
ROCm form (the recipe plus its declared overlay), the same one scripts/amd/run_mimo_7b_rl.py runs.
"""

import sys

from miles.recipes.script import main

if __name__ == "__main__":
    sys.exit(main("mimo_7b_rl"))
