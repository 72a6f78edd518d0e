"""Qwen3.5-35B-A3B GRPO recipe, ROCm form: the shared recipe plus its declared ROCm overlay.

The overlay (profiles, rollout backends, environment, pins) is `ROCM` in
miles/recipes/library/qwen3_5_35b_a3b.py; `python -m miles.recipes diff qwen3_5_35b_a3b` prints every difference
from the shared recipe. Nothing here is a copy of scripts/run_qwen3_5_35b_a3b.py.
"""

import sys

from miles.recipes.script import main

if __name__ == "__main__":
    sys.exit(main("qwen3_5_35b_a3b", platform="rocm"))
