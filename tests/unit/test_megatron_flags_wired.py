"""No recipe flag is both passed to the Megatron backend and ignored by it.

Every GPU profile of every recipe, on both GPU platforms, is rendered as `run_<model>.py`
renders it; each Megatron and GPU-stack flag of the command must be one the backend acts on
(a row of miles.megatron.options, or a shape flag the family facts table checks against
config.json), and each row's megatron-core fields must exist on megatron-core's own config
classes and carry the flag's value when the backend's wiring functions build them. A flag
without effect is refused at render with its reason; so is one whose needs the platform's
stack lacks, and the backend refuses the same at start.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from miles.megatron import options
from miles.recipes import names, variants
from miles.recipes.launch import RunOptions, build_plan, check_command
from miles.recipes.recipe import RecipeError
from miles.train.args import changed_flags, parse_args


def _gpu_commands():
    for name in names():
        for form in variants(name):
            for profile in form.profiles:
                if profile.platform == "cpu" or form.backend_of(profile) != "megatron":
                    continue
                run = RunOptions(
                    model=profile.model, nodes=profile.nodes, gpus_per_node=profile.gpus_per_node
                )
                plan = build_plan(form, run, profile.platform, base_env={})  # the stack check runs here
                yield f"{name} {profile.platform} {profile.describe()}", profile.platform, plan.train_args


GPU_COMMANDS = list(_gpu_commands())


def _megatron_classes() -> dict[str, set[str]]:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    fields = {
        c.__name__: {f.name for f in dataclasses.fields(c)}
        for c in (DistributedDataParallelConfig, OptimizerConfig)
    }
    fields["TransformerConfig"] = {f.name for f in dataclasses.fields(TransformerConfig)}
    fields["MLATransformerConfig"] = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    return fields


def test_every_gpu_profile_renders_and_both_platforms_are_covered():
    assert {platform for _, platform, _ in GPU_COMMANDS} == {"cuda", "rocm"}
    assert len(GPU_COMMANDS) >= 10


@pytest.mark.parametrize("where,platform,argv", GPU_COMMANDS, ids=[c[0] for c in GPU_COMMANDS])
def test_every_megatron_flag_a_gpu_profile_passes_acts(where, platform, argv):
    scope, family = options.scope(), options.family_flags()
    given = [token for token in argv if token.startswith("--") and token in scope]
    ignored = [
        flag
        for flag in given
        if flag not in family and (flag not in options.BY_FLAG or options.BY_FLAG[flag].refused)
    ]
    assert ignored == [], f"{where}: passed and not acted on: {ignored}"
    assert options.render_problems(argv, platform, stack_has_te=True) == []
    # each row's wiring puts the flag's value into the megatron-core field it names
    args = parse_args(list(argv))
    built = {
        "TransformerConfig": options.transformer_fields(args, "transformer_engine"),
        "DistributedDataParallelConfig": options.ddp_fields(args),
        "OptimizerConfig": options.optimizer_fields(args),
    }
    for flag in given:
        row = options.BY_FLAG.get(flag)
        for field in row.fields if row else ():
            owner, name = field.split(".")
            assert name in built[owner], f"{where}: {flag} names {field}, which its wiring does not set"
    # the backend starts with all of them; a family without a Megatron layout ("cannot build" in the
    # profile's status) is rendered to load through Megatron-Bridge, which the backend refuses
    problems = options.start_problems(args, changed_flags(args), "transformer_engine", "cuda:0")
    bridge = [
        p for p in problems if p.startswith("--megatron-to-hf-mode bridge: Megatron-Bridge is not part of")
    ]
    assert problems == bridge


def test_every_field_a_row_names_is_a_field_of_megatron_cores_config_classes():
    classes = _megatron_classes()
    for row in options.OPTIONS:
        for field in row.fields:
            owner, name = field.split(".")
            assert name in classes[owner], f"{row.flag}: megatron-core's {owner} has no field {name}"
    for flag, check in options.MODEL_CHECKS.items():
        name = getattr(check, "__qualname__", "")
        assert flag in options.BY_FLAG, name


def _args(*argv: str):
    return parse_args(["--hf-checkpoint", "m", "--train-backend", "megatron", *argv])


def test_the_values_reach_megatron_cores_own_configs():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    args = _args("--overlap-grad-reduce", "--overlap-param-gather", "--accumulate-allreduce-grads-in-fp32")
    ddp = DistributedDataParallelConfig(**options.ddp_fields(args))
    assert (ddp.overlap_grad_reduce, ddp.overlap_param_gather, ddp.grad_reduce_in_fp32) == (True, True, True)
    config = OptimizerConfig(lr=1e-6, **options.optimizer_fields(args))
    assert config.overlap_param_gather and config.use_distributed_optimizer
    offload = _args(
        "--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d"
    )
    assert options.optimizer_fields(offload) == {
        "use_distributed_optimizer": True, "overlap_param_gather": False, "use_precision_aware_optimizer": True,
        "optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0, "overlap_cpu_optimizer_d2h_h2d": True,
    }  # fmt: skip
    # Without TE, megatron-core 0.16.1 cannot even check a precision-aware optimizer: its
    # OptimizerConfig.__post_init__ compares TE's version (is_te_min_version("2.1.0")) before
    # anything else, offloaded or not. Hence the row's need of TE.
    with pytest.raises(TypeError):
        OptimizerConfig(lr=1e-6, bf16=True, **options.optimizer_fields(offload))


def test_the_stand_in_spec_runs_unfused_and_the_te_spec_takes_megatron_lms_fusion_defaults():
    args = _args("--no-rope-fusion")
    local = options.transformer_fields(args, "local")
    te = options.transformer_fields(args, "transformer_engine")
    assert not any(local[f] for f in ("apply_rope_fusion", "bias_dropout_fusion", "masked_softmax_fusion"))
    assert te["apply_rope_fusion"] is False and te["bias_dropout_fusion"] and te["masked_softmax_fusion"]


def test_a_flag_without_effect_is_refused_at_render_with_its_reason():
    name, platform, argv = next(c for c in GPU_COMMANDS if c[0].startswith("qwen3_4b cuda"))
    form = next(f for f in variants("qwen3_4b") if f.variant == "shared")
    profile = next(p for p in form.profiles if p.platform == "cuda")
    with pytest.raises(RecipeError) as refused:
        check_command(form, profile, "cuda", (*argv, "--use-flash-attn", "--moe-layer-recompute", "1"))
    message = str(refused.value)
    assert (
        "--use-flash-attn: without effect on --train-backend megatron: megatron-core's models do not read it"
        in message
    )
    assert (
        "--moe-layer-recompute: without effect on --train-backend megatron: python -m miles.train parses it"
        in message
    )


def test_what_a_platform_cannot_run_is_refused_with_what_it_needs():
    argv = [
        "--moe-grouped-gemm",
        "--attention-backend",
        "flash",
        "--overlap-param-gather",
        "--optimizer-cpu-offload",
    ]
    problems = dict(options.render_problems(argv, "cpu", stack_has_te=False))
    assert problems["--moe-grouped-gemm"].endswith(
        "needs Transformer Engine's layer spec (TE installed, a GPU)"
    )
    assert "'flash' selects a kernel of Transformer Engine's attention" in problems["--attention-backend"]
    assert problems["--overlap-param-gather"].endswith("needs --overlap-grad-reduce")
    assert problems["--optimizer-cpu-offload"].endswith("needs a GPU")
    # a GPU stack with TE, but the command asks for the stand-in spec
    local = dict(options.render_problems(["--transformer-impl", "local", "--moe-grouped-gemm"], "cuda", True))
    assert list(local) == ["--moe-grouped-gemm"]


def test_the_backend_refuses_at_start_what_it_would_not_act_on():
    args = _args(
        "--moe-grouped-gemm",
        "--balance-data",
        "--recompute-granularity",
        "selective",
        "--recompute-method",
        "uniform",
    )
    problems = {p.split(":")[0]: p for p in options.start_problems(args, changed_flags(args), "local", "cpu")}
    assert set(problems) == {"--moe-grouped-gemm", "--balance-data", "--recompute-method"}
    assert problems["--moe-grouped-gemm"].endswith(
        "needs Transformer Engine's layer spec (TE installed, a GPU)"
    )
    assert problems["--balance-data"].startswith("--balance-data: miles.train splits each minibatch")
    assert "selective recomputation takes no method" in problems["--recompute-method"]
    bridge = _args("--megatron-to-hf-mode", "bridge")
    assert options.start_problems(bridge, changed_flags(bridge), "local", "cpu") == [
        "--megatron-to-hf-mode bridge: Megatron-Bridge is not part of miles; convert the checkpoint to torch_dist "
        "(invoke prepare-ckpt)"
    ]


def test_model_flags_are_checked_against_the_model_config_json_builds():
    tc = SimpleNamespace(normalization="RMSNorm", qk_layernorm=True, rotary_percent=1.0)
    args = _args(
        "--normalization", "LayerNorm", "--qk-layernorm", "--multi-latent-attention", "--rotary-percent", "1"
    )
    assert options.model_disagreements(args, tc, vocab=151936) == [
        "--normalization LayerNorm: config.json gives normalization='RMSNorm', the flag says 'LayerNorm'",
        "--multi-latent-attention: the model config.json describes has no multi_latent_attention (it would be True)",
    ]
