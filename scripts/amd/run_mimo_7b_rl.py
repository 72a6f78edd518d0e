"""MiMo-7B-RL MTP-only training recipe, ROCm form: the shared recipe plus its declared ROCm overlay.

The overlay (profiles) is `ROCM` in miles/recipes/library/mimo_7b_rl.py;
`python -m miles.recipes diff mimo_7b_rl` prints every difference from the shared recipe. Nothing
here is a copy of scripts/run_mimo_7b_rl.py.
"""

import sys

from miles.recipes.script import main

if __name__ == "__main__":
    sys.exit(main("mimo_7b_rl", platform="rocm"))
