"""GLM-5.2-744B-A40B GRPO recipe, ROCm form: the shared recipe plus its declared ROCm overlay.

The overlay (profiles, rollout backends, environment, pins) is `ROCM` in
miles/recipes/library/glm5_2_744b_a40b.py; `python -m miles.recipes diff glm5_2_744b_a40b` prints every difference
from the shared recipe. Nothing here is a copy of scripts/run_glm5_2_744b_a40b.py.
"""

import sys

from miles.recipes.script import main

if __name__ == "__main__":
    sys.exit(main("glm5_2_744b_a40b", platform="rocm"))
