"""Inkling-Small GRPO recipe, ROCm form: the shared recipe plus its declared ROCm overlay.

The overlay (profiles, rollout backends, environment, pins) is `ROCM` in
miles/recipes/library/inkling.py; `python -m miles.recipes diff inkling` prints every difference
from the shared recipe. Nothing here is a copy of scripts/run_inkling.py.
"""

import sys

from miles.recipes.script import main

if __name__ == "__main__":
    sys.exit(main("inkling", platform="rocm"))
