"""The deepseek_v4 recipe end to end: DeepSeek-V4-Flash (4-layer slice).

On 4 GPUs the CUDA or ROCm profile prepares and trains (3 rollouts, --ci-test); the recipe comes from
miles.recipes.load(), which picks the ROCm form on a ROCm runner. On CPU every recipe's tiny
profile is trained by tests/e2e/test_train_recipes_tiny.py.
It trains with the Megatron backend (miles' own DeepSeek-V4 model) at the recipe's layout (TP 4
with sequence parallelism, EP 4), from the torch_dist prepare-ckpt converts: untested on GPU.
est_time is an estimate: no GPU run of this test has been measured yet.
"""

from __future__ import annotations

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci

register_cuda_ci(
    est_time=1900,
    suite="stage-c-4-gpu-h200",
    labels=["megatron", "model-scripts"],
)
register_rocm_ci(
    est_time=1900,
    suite="stage-c-4-gpu-mi350",
    labels=["megatron", "model-scripts", "amd"],
)
register_ci_gate(metric_key="train/grad_norm")


def test_deepseek_v4_recipe_prepares_and_trains(train_recipe):
    train_recipe("deepseek_v4")
