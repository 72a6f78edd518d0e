"""The 4-GPU layouts of our own (no upstream run states them) start: each recipe form's command,
its layout scaled to two CPU ranks (tests/megatron/dry_start.py: context, then pipeline, then
tensor parallelism halved until the dense grid fits, then expert parallelism), the model flags
at a tiny checkpoint's sizes, the flags that act only on a GPU left out, then `python -m
miles.train ... --dry-start`: every rank builds its model chunk and loads the converted
checkpoint. Together with megatron-core's own rank grids at the layout's world size
(tests/parallel/test_megatron_agreement.py, every GPU profile), this is the evidence each such
layout's deviation names (miles.recipes.fidelity.Deviation.evidence).
"""

from __future__ import annotations

import json

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import dry_start as dry

register_cpu_ci(est_time=20, suite="stage-b-cpu")


# (recipe, platform): the forms whose 4-GPU layout is miles' own, and their tiny family
OWN_LAYOUTS = {
    ("qwen3_4b", "cuda"): "qwen3",
    ("qwen3_30b_a3b", "cuda"): "qwen3_moe",
    ("qwen3_30b_a3b", "rocm"): "qwen3_moe",
}


@pytest.mark.parametrize(("recipe", "platform"), list(OWN_LAYOUTS), ids=lambda v: str(v))
def test_a_layout_of_our_own_dry_starts_on_cpu_ranks_scaled_from_it(recipe, platform, tmp_path):
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.ckpt.torch_dist import convert_to_torch_dist

    family = OWN_LAYOUTS[(recipe, platform)]
    argv, hf, ref = dry.gpu_command(recipe, tmp_path, platform)
    make_tiny_checkpoint(family, 2, hf)  # under the name the plan gives the prepared checkpoint
    ref.mkdir()
    convert_to_torch_dist(hf, ref, family)
    layout = dry.scaled_to_two(argv)
    dry.scale(argv, family, json.loads((hf / "config.json").read_text()), layout)
    dry.without_gpu_only(argv)
    out = dry.dry_start(argv)
    tp, ep = layout["--tensor-model-parallel-size"], layout.get("--expert-model-parallel-size", 1)
    assert f"tp{tp}·" in out and f"·ep{ep}·" in out and f"holds {ref}; no rollout" in out, out[-3000:]
