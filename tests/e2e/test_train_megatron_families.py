"""Qwen2.5-0.5B, GLM-5.2, Inkling-Small and DeepSeek-V4 train their tiny profiles with Megatron on CPU and learn the echo task.

Qwen2.5-0.5B's tiny profile trains with megatron-core at TP=2 with sequence parallelism (its q/k/v
biases split over both ranks), GLM-5.2's at TP=2 with sequence parallelism and EP=2 (its MLA, DSA indexer with a shared layer, sigmoid-routed experts and shared expert split over both),
Inkling-Small's at the same layout (its short convolutions with the sequence-parallel halo,
relative bias, sliding and global layers, shared-expert-sink router), and DeepSeek-V4's too
(miles' own model: hybrid attention, hyper-connections, hash and sqrt-softplus routers), each on
two gloo ranks by the recipe's own command (its --ci-test checks on), and each learns
`synthetic:echo` (tests/support/learning.py); their trainer and rollout logprobs agree (Qwen2.5's
to 1e-3, the others' to 1e-5 in fp32), GLM's checkpoint marker says the last rollout, and Inkling's router keeps its expert bias
(nothing trains it) while its global scale is trained.
"""

from __future__ import annotations

from pathlib import Path

from miles.ci.register import register_cpu_ci
from tests.support import recipes as runs
from tests.support.learning import DSV4, GLM, INKLING, QWEN2, assert_learns_the_prompt, train

register_cpu_ci(est_time=165, suite="stage-b-cpu")


def test_megatron_qwen2_tp2_learns_a_task_that_needs_the_prompt(tmp_path):
    plan, record = train(tmp_path, QWEN2)
    args = " ".join(plan.train_args)
    assert "--train-backend megatron" in args and "--tensor-model-parallel-size 2" in args
    assert_learns_the_prompt(record, QWEN2["rollouts"])
    gap = runs.series(record, "train/train_rollout_logprob_abs_diff")
    assert max(gap.values()) < 1e-3, gap


def test_megatron_glm_tp2_ep2_learns_a_task_that_needs_the_prompt(tmp_path):
    plan, record = train(tmp_path, GLM)
    args = " ".join(plan.train_args)
    assert "--train-backend megatron" in args and "--tensor-model-parallel-size 2" in args
    assert "--expert-model-parallel-size 2" in args and "--sequence-parallel" in args
    assert_learns_the_prompt(record, GLM["rollouts"])
    diffs = runs.series(record, "train/train_rollout_logprob_abs_diff")
    assert max(diffs.values()) <= 1e-5, (
        diffs
    )  # fp32: megatron's and transformers' forwards of the same weights
    marker = runs.checkpoint_dir(plan) / "latest_checkpointed_iteration.txt"
    assert marker.read_text().strip() == str(GLM["rollouts"])  # learning runs save after their last rollout


def test_megatron_inkling_tp2_ep2_learns_a_task_that_needs_the_prompt(tmp_path):
    plan, record = train(tmp_path, INKLING)
    args = " ".join(plan.train_args)
    assert "--train-backend megatron" in args and "--tensor-model-parallel-size 2" in args
    assert "--expert-model-parallel-size 2" in args and "--sequence-parallel" in args
    assert_learns_the_prompt(record, INKLING["rollouts"], INKLING["window"])
    diffs = runs.series(record, "train/train_rollout_logprob_abs_diff")
    assert max(diffs.values()) <= 1e-5, diffs  # fp32: megatron's and transformers' forwards alike
    # the expert bias only selects experts and nothing updates it (transformers keeps it a
    # buffer); the router's global scale is trained
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from miles.ckpt.shards import CheckpointReader
    from miles.megatron.checkpoint import single_process_group

    saved = str(runs.checkpoint_dir(plan) / f"iter_{INKLING['rollouts']:07d}")
    hf_dir = Path(plan.train_args[plan.train_args.index("--hf-checkpoint") + 1])
    router = "decoder.layers.1.mlp.router."
    with single_process_group(), CheckpointReader(hf_dir) as hf:
        shapes = dist_checkpointing.load_tensors_metadata(saved)
        template = {
            name: ShardedTensor.from_rank_offsets(
                router + name, torch.empty(shapes[router + name].local_shape), replica_id=0
            )
            for name in ("expert_bias", "global_scale")
        }
        trained = dist_checkpointing.load(template, saved)
        assert torch.equal(trained["expert_bias"], hf.read("model.layers.1.mlp.gate.e_score_correction_bias"))
        assert not torch.equal(trained["global_scale"], hf.read("model.layers.1.mlp.gate.global_scale"))


def test_megatron_dsv4_tp2_ep2_learns_a_task_that_needs_the_prompt(tmp_path):
    plan, record = train(tmp_path, DSV4)
    args = " ".join(plan.train_args)
    assert "--train-backend megatron" in args and "--tensor-model-parallel-size 2" in args
    assert "--expert-model-parallel-size 2" in args and "--sequence-parallel" in args
    assert_learns_the_prompt(record, DSV4["rollouts"])
    diffs = runs.series(record, "train/train_rollout_logprob_abs_diff")
    assert max(diffs.values()) <= 1e-5, (
        diffs
    )  # fp32: miles' DeepSeek-V4 and transformers' of the same weights
