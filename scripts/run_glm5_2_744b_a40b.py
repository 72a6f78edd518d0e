"""GLM-5.2-744B-A40B GRPO recipe: `python scripts/run_glm5_2_744b_a40b.py {prepare,train,full-train} [--dry-run] [--help]`.

The recipe is data in miles/recipes/library/glm5_2_744b_a40b.py. On a ROCm machine this script runs the
ROCm form (the recipe plus its declared overlay), the same one scripts/amd/run_glm5_2_744b_a40b.py runs.
"""

import sys

from miles.recipes.script import main

if __name__ == "__main__":
    sys.exit(main("glm5_2_744b_a40b"))
