"""The trainer's flags: the seeds' names parse, cross-flag rules fail with the fix named."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from miles.ci.register import register_cpu_ci
from miles.train.args import ArgsError, parse_args, parse_config, split_sglang_args, validate_world

register_cpu_ci(est_time=1, suite="stage-a-cpu")

# A Qwen3-4B GRPO command in the shape of the seeds' recipes (model, checkpoint, rollout, GRPO,
# optimizer, SGLang, perf and misc argument groups).
SEEDS_COMMAND = """
--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32
--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear
--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 --kv-channels 128
--qk-layernorm
--hf-checkpoint /models/Qwen3-4B --ref-load /models/Qwen3-4B_torch_dist --load /ckpt/qwen3-4b
--save /ckpt/qwen3-4b --save-interval 20
--prompt-data /data/dapo-math-17k.jsonl --input-key prompt --label-key label --apply-chat-template
--rollout-shuffle --rm-type deepscaler --num-rollout 3000 --rollout-batch-size 32
--n-samples-per-prompt 8 --rollout-max-response-len 8192 --rollout-temperature 0.8
--global-batch-size 256 --balance-data
--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl
--entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1
--context-parallel-size 1 --expert-model-parallel-size 1 --expert-tensor-parallel-size 1
--recompute-granularity full --recompute-method uniform --recompute-num-layers 1
--use-dynamic-batch-size --max-tokens-per-gpu 9216
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32
--attention-softmax-in-fp32 --attention-backend flash
--actor-num-nodes 1 --actor-num-gpus-per-node 4 --colocate --train-backend megatron --ci-test
--sglang-enable-dp-attention --sglang-dp-size 2 --sglang-cuda-graph-bs 1 2 4 8
--sglang-moe-a2a-backend=mori
""".split()


def test_seeds_style_command_parses_with_every_group():
    args = parse_args(SEEDS_COMMAND)
    assert args.hf_checkpoint == "/models/Qwen3-4B"
    assert args.rollout_batch_size * args.n_samples_per_prompt == args.global_batch_size == 256
    assert (args.eps_clip, args.eps_clip_high, args.kl_loss_type) == (0.2, 0.28, "low_var_kl")
    assert (args.lr, args.weight_decay, args.adam_beta2) == (1e-6, 0.1, 0.98)
    assert args.tensor_model_parallel_size == 2 and args.sequence_parallel
    assert args.num_query_groups == 8 and args.qk_layernorm
    assert args.sglang_mem_fraction_static == 0.7


def test_sglang_flags_pass_through_as_switches_values_and_lists():
    args = parse_args(SEEDS_COMMAND)
    assert args.sglang_args == {
        "enable_dp_attention": True,
        "dp_size": "2",
        "cuda_graph_bs": ["1", "2", "4", "8"],
        "moe_a2a_backend": "mori",
    }


def test_sglang_flag_the_parser_defines_is_not_passed_through():
    rest, passthrough = split_sglang_args(
        ["--sglang-mem-fraction-static", "0.7"], {"--sglang-mem-fraction-static"}
    )
    assert rest == ["--sglang-mem-fraction-static", "0.7"] and passthrough == {}


def test_defaults_fill_eps_clip_high_global_batch_and_rollout_seed():
    args = parse_args(["--hf-checkpoint", "m", "--eps-clip", "0.3", "--seed", "7"])
    assert args.eps_clip_high == 0.3
    assert args.global_batch_size == args.rollout_batch_size * args.n_samples_per_prompt
    assert args.rollout_seed == 7


def test_unknown_flag_is_an_error_on_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--hf-checkpoint", "m", "--num-rolout", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --num-rolout 3" in err
    assert len(err.splitlines()) == 2


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit):
        parse_args(["--hf-checkpoint", "m", *argv])
    return capsys.readouterr().err


def test_global_batch_must_divide_the_rollout_samples(capsys):
    err = _error(
        ["--rollout-batch-size", "3", "--n-samples-per-prompt", "4", "--global-batch-size", "8"], capsys
    )
    assert "= 12 samples per rollout must be a multiple of --global-batch-size (8)" in err


def test_a_partial_step_trains_the_rest_of_a_rollout_as_one_smaller_step():
    from miles.train.config import optimizer_steps, step_sizes

    argv = ["--hf-checkpoint", "m", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4"]
    config = parse_config(
        [*argv, "--global-batch-size", "24", "--allow-partial-train-step", "--disable-rollout-trim-samples"]
    )
    assert step_sizes(32, 24, partial=True) == [24, 8] and step_sizes(32, 24) == [24]
    assert (
        optimizer_steps(config.rollout, config.batch) == 2 * config.rollout.num_rollout
    )  # the lr schedule's
    assert step_sizes(48, 24, partial=True) == [24, 24]
    validate_world(config, 2)


def test_partial_step_flags_that_could_not_act_are_refused(capsys):
    argv = ["--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "24"]
    err = _error([*argv, "--allow-partial-train-step"], capsys)
    assert "the rollout is trimmed to whole steps first; add --disable-rollout-trim-samples" in err
    err = _error([*argv, "--disable-rollout-trim-samples"], capsys)
    assert "keeps the 8 samples past the last whole --global-batch-size (24)" in err
    assert "add --allow-partial-train-step" in err
    assert "--allow-partial-train-step --disable-rollout-trim-samples" in _error(argv, capsys)


def test_group_of_one_sample_is_rejected(capsys):
    assert "--n-samples-per-prompt must be >= 2" in _error(["--n-samples-per-prompt", "1"], capsys)


def test_model_parallel_sizes_need_the_megatron_backend(capsys):
    err = _error(["--tensor-model-parallel-size", "2"], capsys)
    assert "--train-backend fsdp is data-parallel only" in err and "--tensor-model-parallel-size 2" in err


def test_dual_clip_constant_must_exceed_one(capsys):
    assert "--eps-clip-c must be > 1" in _error(["--eps-clip-c", "0.5"], capsys)


def test_remote_reward_model_is_refused_before_anything_loads(capsys):
    err = _error(["--rm-url", "http://127.0.0.1:8000"], capsys)
    assert "--rm-url http://127.0.0.1:8000: a remote reward model serves only on-policy distillation" in err


def test_distillation_flags_are_refused_without_use_opd_and_its_teacher(capsys):
    assert "add --use-opd or drop them" in _error(["--opd-kl-coef", "0.5"], capsys)
    err = _error(["--use-opd", "--opd-type", "sglang"], capsys)
    assert "--use-opd needs the teacher's URL" in err and "--rm-url http://HOST:PORT/generate" in err
    err = _error(["--use-opd", "--opd-type", "megatron"], capsys)
    assert "--opd-type megatron" in err and "not supported" in err


def test_megatron_layout_is_checked_by_miles_parallel_with_the_fix(tmp_path, capsys):
    model = tmp_path / "moe"
    model.mkdir()
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "num_experts": 8}
    (model / "config.json").write_text(json.dumps(config))
    argv = [
        "--hf-checkpoint", str(model), "--train-backend", "megatron", "--actor-num-gpus-per-node", "4",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1", "--sequence-parallel",
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        parse_args(argv)
    err = capsys.readouterr().err
    assert "does not divide world size 4" in err and "ep=2" in err
    argv[argv.index("--expert-model-parallel-size") + 1] = "2"
    assert parse_args(argv).expert_model_parallel_size == 2


def test_world_size_must_split_batches_evenly():
    config = parse_config(
        ["--hf-checkpoint", "m", "--rollout-batch-size", "3", "--n-samples-per-prompt", "2"]
    )
    with pytest.raises(ArgsError, match="--global-batch-size \\(6\\) must split evenly over 4"):
        validate_world(config, 4)


def test_a_launch_of_other_ranks_than_the_job_flags_ask_for_is_named():
    from miles.train.args import world_note

    config = parse_config(["--hf-checkpoint", "m", "--actor-num-gpus-per-node", "4"])
    assert world_note(config, 2) == (
        "the process group has 2 rank(s), not the 4 that --actor-num-nodes 1 x --actor-num-gpus-per-node 4 ask for"
    )
    assert world_note(config, 4) is None
    assert world_note(parse_config(["--hf-checkpoint", "m"]), 2) is None  # not given: the launch decides


def test_loss_config_carries_the_algorithm_flags():
    config = parse_config(["--hf-checkpoint", "m", "--advantage-estimator", "gspo", "--use-tis"])
    cfg = config.algorithm.loss_config(config.rollout.rollout_temperature)
    assert cfg.advantage_estimator == "gspo" and cfg.use_tis and cfg.eps_clip_high == cfg.eps_clip


def test_parsing_flags_imports_no_heavy_package():
    code = (
        "import sys; from miles.train.args import parse_args; parse_args(['--hf-checkpoint', 'm']); "
        "print(sorted(m for m in ('torch', 'transformers', 'megatron') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_flags_the_chosen_stack_ignores_are_refused_in_one_line_not_dropped():
    from miles.train.consumption import refusal

    config = parse_config(
        "--hf-checkpoint m --colocate --use-wandb --num-layers 4 --hidden-size 64 "
        "--sglang-mem-fraction-static 0.7 --sglang-enable-dp-attention".split()
    )
    refused = refusal(config, "torch")
    assert "\n" not in refused
    assert "--use-wandb (read by no component)" in refused
    assert "--colocate (the built-in engine samples inside the trainer's processes" in refused
    assert "--num-layers --hidden-size (read by --train-backend megatron)" in refused
    assert (
        "--sglang-mem-fraction-static --sglang-enable-dp-attention (read by the sglang rollout engine and the "
        "sglang rollout engines in processes of their own (--rollout-num-gpus))" in refused
    )
    assert "no effect on --train-backend fsdp with the torch rollout engine, so refused; drop them" in refused
    assert refusal(parse_config(["--hf-checkpoint", "m"]), "torch") is None


def test_deterministic_collectives_refuse_overlapped_gradient_reduction(capsys):
    err = _error(
        ["--train-backend", "megatron", "--debug-deterministic-collective", "--overlap-grad-reduce"], capsys
    )
    assert "--debug-deterministic-collective folds each reduction as it is called" in err
    assert "drop --overlap-grad-reduce" in err


def test_critic_flags_without_ppo_are_refused_and_ppo_needs_no_groups(capsys):
    err = _error(["--critic-lr", "1e-5", "--gamma", "0.9"], capsys)
    assert (
        "--gamma --critic-lr configure PPO's critic, which --advantage-estimator grpo does not train" in err
    )
    config = parse_config(
        [
            "--hf-checkpoint",
            "m",
            "--advantage-estimator",
            "ppo",
            "--n-samples-per-prompt",
            "1",
            "--critic-lr",
            "1e-5",
        ]
    )
    assert config.algorithm.uses_critic
    assert config.optimizer.optim_config(config.algorithm, critic=True).lr == 1e-5
    assert config.optimizer.optim_config(config.algorithm).lr == config.optimizer.lr
