"""Each other recipe's CPU `tiny` profile trains for 2 rollouts with 2 gloo ranks.

Qwen3-30B-A3B (qwen3_moe), Inkling, DeepSeek-V4, GLM-4.7-Flash and Qwen3.5-35B-A3B (qwen3_5_moe,
Megatron at EP 2: its gated delta net on megatron-core's torch rule) all have transformers classes
that run on CPU, so every recipe's real architecture goes through the whole loop (rollout, reward,
GRPO step with the KL reference, weight sync, --ci-test checks, checkpoint) on every PR. extra_args keep
it to 2 rollouts of 4-token answers; DeepSeek-V4's and GLM-4.7-Flash's tiny profiles train with
Megatron at TP 2 with sequence parallelism and EP 2 (GLM-4.7-Flash's with routing replay, as its
recipe has it). The qwen3_4b recipe has its own, longer test
(test_train_grpo_tiny.py), and GLM-5.2's tiny profile (Megatron at TP 2 and EP 2) learns a task
in tests/e2e/test_train_megatron_families.py.
"""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import recipes as runs

register_cpu_ci(est_time=20, suite="stage-b-cpu")


ROLLOUTS = 2


@pytest.mark.parametrize("recipe", ["qwen3_30b_a3b", "inkling", "deepseek_v4", "glm47_flash", "qwen3_5_35b_a3b"])
def test_recipe_tiny_profile_trains_two_rollouts_on_cpu(recipe, tmp_path):
    plan = runs.tiny_plan(recipe, tmp_path, "--num-rollout", str(ROLLOUTS), "--rollout-max-response-len", "4")
    assert runs.launch(plan, tmp_path / "record") == 0
    for key in (
        "rollout/raw_reward",
        "train/grad_norm",
        "train/ppo_kl",
        "train/train_rollout_logprob_abs_diff",
    ):
        assert sorted(runs.series(tmp_path / "record", key)) == list(range(ROLLOUTS)), key
    marker = runs.checkpoint_dir(plan) / "latest_checkpointed_iteration.txt"
    assert marker.read_text().strip() == str(ROLLOUTS)
