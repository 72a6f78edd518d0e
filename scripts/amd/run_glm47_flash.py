"""GLM-4.7-Flash GRPO recipe, ROCm form: the shared recipe plus its declared ROCm overlay.

The overlay (profiles, rollout backends, environment, pins) is `ROCM` in
miles/recipes/library/glm47_flash.py; `python -m miles.recipes diff glm47_flash` prints every difference
from the shared recipe. Nothing here is a copy of scripts/run_glm47_flash.py.
"""

import sys

from miles.recipes.script import main

if __name__ == "__main__":
    sys.exit(main("glm47_flash", platform="rocm"))
