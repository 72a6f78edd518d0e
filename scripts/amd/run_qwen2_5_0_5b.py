"""Qwen2.5-0.5B-Instruct GSM8K GRPO recipe, ROCm form: the shared recipe plus its declared ROCm overlay.

The overlay (profiles) is `ROCM` in miles/recipes/library/qwen2_5_0_5b.py;
`python -m miles.recipes diff qwen2_5_0_5b` prints every difference from the shared recipe. Nothing
here is a copy of scripts/run_qwen2_5_0_5b.py.
"""

import sys

from miles.recipes.script import main

if __name__ == "__main__":
    sys.exit(main("qwen2_5_0_5b", platform="rocm"))
