"""GLM-4.7-Flash GRPO recipe: `python scripts/run_glm47_flash.py {prepare,train,full-train} [--dry-run] [--help]`.

The recipe is data in miles/recipes/library/glm47_flash.py. On a ROCm machine this script runs the
ROCm form (the recipe plus its declared overlay), the same one scripts/amd/run_glm47_flash.py runs.
"""

import sys

from miles.recipes.script import main

if __name__ == "__main__":
    sys.exit(main("glm47_flash"))
