"""The glm47_flash recipe end to end: GLM-4.7-Flash with routing replay.

On 8 GPUs the CUDA profile prepares and trains (3 rollouts, --ci-test) at the reference's layout
(TP 4 with sequence parallelism, EP 8), from the torch_dist prepare-ckpt converts; its ROCm form
has no profile (the seed has no AMD launcher for it; its MI350 case is
tests/e2e/megatron/test_glm47_flash/test_amd_r3_mtp.py). On CPU the tiny profile is trained by
tests/e2e/test_train_recipes_tiny.py. Untested on GPU: est_time is an estimate.
"""

from __future__ import annotations

from miles.ci.register import register_ci_gate, register_cuda_ci

register_cuda_ci(est_time=900, suite="stage-c-8-gpu-h200", labels=["megatron", "model-scripts"])
register_ci_gate(metric_key="train/grad_norm")


def test_glm47_flash_recipe_prepares_and_trains(train_recipe):
    train_recipe("glm47_flash")
