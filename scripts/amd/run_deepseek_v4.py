"""DeepSeek-V4-Flash GRPO recipe, ROCm form: the shared recipe plus its declared ROCm overlay.

The overlay (profiles, rollout backends, environment, pins) is `ROCM` in
miles/recipes/library/deepseek_v4.py; `python -m miles.recipes diff deepseek_v4` prints every difference
from the shared recipe. Nothing here is a copy of scripts/run_deepseek_v4.py.
"""

import sys

from miles.recipes.script import main

if __name__ == "__main__":
    sys.exit(main("deepseek_v4", platform="rocm"))
