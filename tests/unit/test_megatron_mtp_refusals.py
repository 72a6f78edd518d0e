"""What --enable-mtp-training refuses before any model is built, and what it takes: the layouts and
families the Megatron backend can train MTP layers with (the runs themselves:
tests/e2e/test_train_mtp_speculative.py; under context parallelism, the MTP logits:
tests/megatron/test_megatron_qwen3_5.py)."""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from miles.families import family

register_cpu_ci(est_time=1, suite="stage-a-cpu")

GLM = family("glm_moe_dsa").tiny_dims | {"model_type": "glm_moe_dsa", "num_nextn_predict_layers": 1}
QWEN3_5 = family("qwen3_5_moe").tiny_dims | {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 4}
MIMO = family("mimo").tiny_dims | {"model_type": "mimo", "num_hidden_layers": 2}
MTP = ("--enable-mtp-training", "--mtp-loss-scaling-factor", "0.5")


def scale(config: dict, *flags: str) -> float | None:
    from miles.train.args import parse_config
    from miles.train.backends.megatron import _mtp_training

    run = parse_config(
        ["--hf-checkpoint", "/ckpt", "--train-backend", "megatron", "--actor-num-gpus-per-node", "2", *flags]
    )
    return _mtp_training(run.megatron, run.model, config, run.layout, run.lora, "/ckpt")


@pytest.mark.parametrize("config", [GLM, QWEN3_5, MIMO], ids=["glm_moe_dsa", "qwen3_5_moe", "mimo"])
def test_every_mtp_style_trains_at_one_stage_and_under_pipeline_parallelism(config):
    assert scale(config, *MTP) == 0.5
    assert scale(config, *MTP, "--pipeline-model-parallel-size", "2") == 0.5
    assert scale(config) is None  # not asked for


def test_mtp_only_training_under_pipeline_parallelism_is_refused_with_the_stage_that_would_train_nothing():
    from miles.train.backends.megatron import MegatronSetupError

    assert scale(GLM, *MTP, "--mtp-only-training") == 0.5
    with pytest.raises(MegatronSetupError, match=r"--mtp-only-training with pipeline parallelism \(2\)"):
        scale(GLM, *MTP, "--mtp-only-training", "--pipeline-model-parallel-size", "2")


def test_a_mimo_config_without_mtp_layers_is_refused_with_the_key_to_set():
    from miles.train.backends.megatron import MegatronSetupError

    with pytest.raises(MegatronSetupError, match=r"declares no MTP layers \(num_nextn_predict_layers\)"):
        scale(MIMO | {"num_nextn_predict_layers": 0}, *MTP)


def test_context_parallelism_trains_them_too():
    # megatron-core's MTP block rolls its inputs across the context-parallel chunks; the trainer
    # gathers the MTP layers' logprobs as it gathers the policy's
    assert scale(QWEN3_5, *MTP, "--context-parallel-size", "2") == 0.5


DSV4 = family("deepseek_v4").tiny_dims | {"model_type": "deepseek_v4", "num_hidden_layers": 4}


def test_deepseek_v4s_own_model_trains_its_mtp_layer_at_one_stage_and_refuses_pipeline_parallelism():
    # its MTP layer reads the word embedding, which its model keeps on the first stage only
    from miles.train.backends.megatron import MegatronSetupError

    assert DSV4.get("num_nextn_predict_layers")
    assert scale(DSV4, *MTP) == 0.5
    assert scale(DSV4, *MTP, "--tensor-model-parallel-size", "2", "--sequence-parallel") == 0.5
    with pytest.raises(
        MegatronSetupError, match=r"with pipeline parallelism \(2\): DeepSeek-V4's MTP layers read"
    ):
        scale(DSV4, *MTP, "--pipeline-model-parallel-size", "2")
