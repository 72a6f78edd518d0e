"""No recipe flag is both passed to the Megatron backend and ignored by it without a word.

Every GPU profile of every recipe, on both GPU platforms, is rendered as `run_<model>.py`
renders it. Whether a component acts on a flag is declared on the flag's field (`by=`,
miles.train.config; read by miles.train.consumption): each flag of the command that the backend takes (the Megatron
options, the model shape, the layout) must be one it consumes, and the rest of what the run
leaves unconsumed must be flags no component of miles acts on yet, which the run's start-up
note names. How the backend acts on each is its row of miles.megatron.options: every row's
megatron-core fields exist on megatron-core's own config classes and carry the flag's value
when the wiring functions build them from the trainer's sections; a row's flag is consumed
exactly when the row does not refuse it. A flag whose needs the platform's stack lacks is
refused at render with its reason, and the backend refuses the same at start.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from miles.ci.register import register_cpu_ci
from miles.megatron import options
from miles.recipes import names, variants
from miles.recipes.launch import RunOptions, build_plan, check_command
from miles.recipes.recipe import RecipeError
from miles.train import consumption
from miles.train.args import parse_config
from miles.train.config import flag_of

register_cpu_ci(est_time=2, suite="stage-a-cpu")

MEGATRON = consumption.backend("megatron")
# the sections only the Megatron backend reads: a flag of them it does not consume is its own to answer for
BACKEND_SECTIONS = ("megatron", "model", "layout")


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


def _no_component_acts_on(option: str) -> bool:
    everyone = [consumption.trainer(), *map(consumption.backend, consumption.BACKENDS)]
    everyone += map(consumption.engine, consumption.ENGINES)
    return not any(c.consumes(flag_of(option)) for c in everyone)


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
    config = parse_config(list(argv))
    unused = consumption.flags_without_effect(config, "sglang")
    own = [f for f in unused if flag_of(f).section in BACKEND_SECTIONS]
    assert own == [], f"{where}: passed to the Megatron backend, which does not consume them: {own}"
    # what is left, no component of miles acts on (the render refuses it)
    assert [f for f in unused if not _no_component_acts_on(f)] == [], where
    assert options.render_problems(argv, platform, stack_has_te=True) == []
    # each row's wiring puts the flag's value into the megatron-core field it names
    built = {
        "TransformerConfig": options.transformer_fields(config.megatron, "transformer_engine"),
        "DistributedDataParallelConfig": options.ddp_fields(config.megatron),
        "OptimizerConfig": options.optimizer_fields(config.megatron),
    }
    for flag in config.flags_set:
        row = options.BY_FLAG.get(flag)
        for field in row.fields if row else ():
            owner, name = field.split(".")
            assert name in built[owner], f"{where}: {flag} names {field}, which its wiring does not set"
    # and the backend, on a GPU with TE's spec, starts with all of them
    given = {**config.megatron.non_default(), **config.model.non_default(), **config.checkpoint.non_default()}
    assert options.start_problems(given, "transformer_engine", "cuda:0") == []


def test_a_row_acts_exactly_when_the_backend_consumes_its_flag():
    for row in options.OPTIONS:
        consumed = MEGATRON.consumes(flag_of(row.flag))
        assert consumed != bool(row.refused), f"{row.flag}: consumed {consumed}, refused {row.refused!r}"
    rows = {row.flag for row in options.OPTIONS}
    unexplained = [
        f"--{name.replace('_', '-')}"
        for name in MEGATRON.uses["megatron"]
        if f"--{name.replace('_', '-')}" not in rows
    ]
    assert unexplained == [], "consumed Megatron options without a row saying how they act"


def test_every_field_a_row_names_is_a_field_of_megatron_cores_config_classes():
    classes = _megatron_classes()
    for row in options.OPTIONS:
        for field in row.fields:
            owner, name = field.split(".")
            assert name in classes[owner], f"{row.flag}: megatron-core's {owner} has no field {name}"
    for flag, check in options.MODEL_CHECKS.items():
        name = getattr(check, "__qualname__", "")
        assert flag in options.BY_FLAG, name


def _config(*argv: str):
    return parse_config(["--hf-checkpoint", "m", "--train-backend", "megatron", *argv])


def _given(config) -> dict:
    """What the backend hands start_problems: the flags its sections set."""
    return {**config.megatron.non_default(), **config.checkpoint.non_default(), **config.model.non_default()}


def test_the_values_reach_megatron_cores_own_configs():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    megatron = _config(
        "--overlap-grad-reduce", "--overlap-param-gather", "--accumulate-allreduce-grads-in-fp32"
    ).megatron
    ddp = DistributedDataParallelConfig(**options.ddp_fields(megatron))
    assert (ddp.overlap_grad_reduce, ddp.overlap_param_gather, ddp.grad_reduce_in_fp32) == (True, True, True)
    config = OptimizerConfig(lr=1e-6, **options.optimizer_fields(megatron))
    assert config.overlap_param_gather and config.use_distributed_optimizer and ddp.use_distributed_optimizer
    offload = _config(
        "--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d"
    ).megatron
    assert options.optimizer_fields(offload) == {
        "overlap_param_gather": False, "use_distributed_optimizer": True, "use_precision_aware_optimizer": True,
        "optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0, "overlap_cpu_optimizer_d2h_h2d": True,
    }  # fmt: skip
    # Without TE, megatron-core 0.16.1 cannot even check a precision-aware optimizer: its
    # OptimizerConfig.__post_init__ compares TE's version (is_te_min_version("2.1.0")) before
    # anything else, offloaded or not. Hence the row's need of TE.
    with pytest.raises(TypeError):  # the distributed optimizer, as miles.megatron.training always builds
        OptimizerConfig(lr=1e-6, bf16=True, **options.optimizer_fields(offload))


def test_the_stand_in_spec_runs_unfused_and_the_te_spec_takes_megatron_lms_fusion_defaults():
    megatron = _config("--no-rope-fusion").megatron
    local = options.transformer_fields(megatron, "local")
    # as on a GPU machine where every kernel a fusion runs imports (miles.megatron.fusions
    # decides where they do; tests/unit/test_megatron_fusions.py)
    te = options.transformer_fields(megatron, "transformer_engine", imports=lambda module: True)
    assert not any(local[f] for f in ("apply_rope_fusion", "bias_dropout_fusion", "masked_softmax_fusion"))
    assert te["apply_rope_fusion"] is False and te["bias_dropout_fusion"] and te["masked_softmax_fusion"]


def test_a_refused_flag_is_refused_at_render_with_its_reason():
    name, platform, argv = next(c for c in GPU_COMMANDS if c[0].startswith("qwen3_4b cuda"))
    form = next(f for f in variants("qwen3_4b") if f.variant == "shared")
    profile = next(p for p in form.profiles if p.platform == "cuda")
    with pytest.raises(RecipeError) as refused:
        check_command(form, profile, "cuda", (*argv, "--use-flash-attn"))
    assert (
        "--use-flash-attn: --train-backend megatron cannot act on it: megatron-core's models do not read it"
        in str(refused.value)
    )


def test_a_megatron_option_the_backend_does_not_consume_is_refused_at_start_up():
    config = _config("--moe-layer-recompute", "1", "--use-distributed-optimizer")
    assert consumption.flags_without_effect(config, "sglang") == ["--moe-layer-recompute"]
    assert consumption.refusal(config, "sglang") == (
        "--moe-layer-recompute (read by no component): no effect on --train-backend megatron with the sglang "
        "rollout engine, so refused; drop them, or run with the backend or engine that reads them"
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


def test_the_backend_refuses_at_start_what_it_cannot_act_on():
    config = _config(
        "--moe-grouped-gemm",
        "--use-flash-attn",
        "--recompute-granularity",
        "selective",
        "--recompute-method",
        "uniform",
    )
    problems = {p.split(":")[0]: p for p in options.start_problems(_given(config), "local", "cpu")}
    assert set(problems) == {"--moe-grouped-gemm", "--use-flash-attn", "--recompute-method uniform"}
    assert problems["--moe-grouped-gemm"].endswith(
        "needs Transformer Engine's layer spec (TE installed, a GPU)"
    )
    assert problems["--use-flash-attn"].startswith("--use-flash-attn: megatron-core's models do not read it")
    assert "selective recomputation takes no method" in problems["--recompute-method uniform"]
    assert options.start_problems(_given(_config("--moe-grouped-gemm")), "transformer_engine", "cuda:0") == []


def test_loading_through_megatron_bridge_is_refused_before_anything_loads():
    from miles.train.backends.megatron import MegatronSetupError, _weights_source

    with pytest.raises(
        MegatronSetupError, match="^--megatron-to-hf-mode bridge: Megatron-Bridge is not part"
    ):
        _weights_source(_config("--megatron-to-hf-mode", "bridge").checkpoint)


def test_model_flags_are_checked_against_the_model_config_json_builds():
    tc = SimpleNamespace(normalization="RMSNorm", qk_layernorm=True, rotary_percent=1.0)
    model = _config(
        "--normalization", "LayerNorm", "--qk-layernorm", "--multi-latent-attention", "--rotary-percent", "1"
    ).model
    assert options.model_disagreements(model, tc, vocab=151936) == [
        "--normalization LayerNorm: config.json gives normalization='RMSNorm', the flag says 'LayerNorm'",
        "--multi-latent-attention: the model config.json describes has no multi_latent_attention (it would be True)",
    ]


def test_rotary_percent_is_checked_against_the_gpt_model_miles_builds():
    # only MLA's TransformerConfig has the field; a GPTModel is built with rope over the whole head
    # (Qwen3-30B-A3B's GPU command passes --rotary-percent 1.0, as the reference does)
    plain = SimpleNamespace(normalization="RMSNorm")
    assert options.model_disagreements(_config("--rotary-percent", "1.0").model, plain, vocab=151936) == []
    assert options.model_disagreements(_config("--rotary-percent", "0.5").model, plain, vocab=151936) == [
        "--rotary-percent 0.5: miles builds rotary_percent=1.0, the flag says 0.5"
    ]
