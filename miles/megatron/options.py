"""How the Megatron backend acts on each Megatron and GPU-stack flag it consumes: one row per flag.

Which flags the backend acts on is declared on their fields (`by=megatron`, miles.train.config;
miles.train.consumption refuses every flag a command sets that no component of its run acts on). This table says how: the spec choice, a megatron-core
TransformerConfig field (`transformer_fields`), a DistributedDataParallelConfig or
OptimizerConfig field (`ddp_fields`, `optimizer_fields`), a check against the model built from
config.json (`model_disagreements`; the shape flags of the family facts tables are checked by
`check_model_flags`), the layout or the checkpoint. A row also says what its flag needs
(Transformer Engine's layer spec, a GPU, another flag), or why the backend refuses it whenever
it is given (`refused`, for a flag it parses and does not consume). Those needs and refusals
are checked at render time for a recipe (`render_problems`, miles.recipes.stack) and when the
backend starts (`start_problems`). The wiring functions read the trainer's sections (the
`megatron` and `model` sections of miles.train.config) by attribute. Standard library only:
the render reads it without torch. The module is long because it is the one table; each
function sits beside the rows it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from miles.megatron.fusions import FUSIONS, fusion_fields, module_imports

TE = "te"  # needs megatron-core's Transformer Engine layer spec (TE installed, on a GPU)
_FUSED = "off; with the TE spec on where what it runs imports (miles.megatron.fusions), otherwise off"
GPU = "gpu"
TE_ATTENTION = ("flash", "fused", "unfused")  # --attention-backend values TE's attention picks from


@dataclass(frozen=True)
class Option:
    flag: str
    acts: str  # where the value goes, or what it is checked against
    needs: tuple[str, ...] = ()  # TE, GPU, or another flag; "a|b": either
    refused: str = ""  # why the backend refuses it whenever it is given
    fields: tuple[str, ...] = ()  # the megatron-core fields it sets: "TransformerConfig.x", ...


# --- the layer spec (miles.megatron.spec.choose_impl) -------------------------------------

SPEC = (
    Option(
        "--transformer-impl",
        "the layer spec: transformer_engine builds TE's modules (needs TE and a GPU), local the stand-in "
        "with the same keys; unset: TE where it loads on a GPU",
    ),
)

# --- TransformerConfig -----------------------------------------------------------------------

_TC = "TransformerConfig."

TRANSFORMER = (
    Option(
        "--attention-backend",
        "flash, fused and unfused pick TE's attention kernels; local and auto megatron-core's own",
        fields=(_TC + "attention_backend",),
    ),
    Option(
        "--moe-grouped-gemm",
        "TE's grouped-GEMM experts (TEGroupedMLP)",
        (TE,),
        fields=(_TC + "moe_grouped_gemm",),
    ),
    Option(
        "--moe-permute-fusion", "TE's fused token permutation", (TE,), fields=(_TC + "moe_permute_fusion",)
    ),
    Option(
        "--moe-token-dispatcher-type", "the MoE token dispatcher", fields=(_TC + "moe_token_dispatcher_type",)
    ),
    Option("--moe-router-dtype", "the router's logits dtype", fields=(_TC + "moe_router_dtype",)),
    Option(
        "--moe-aux-loss-coeff",
        "the load-balancing loss (of type aux_loss unless --moe-router-load-balancing-type says)",
        fields=(_TC + "moe_aux_loss_coeff",),
    ),
    Option("--moe-router-load-balancing-type", "", fields=(_TC + "moe_router_load_balancing_type",)),
    Option("--moe-router-bias-update-rate", "", fields=(_TC + "moe_router_bias_update_rate",)),
    Option("--moe-z-loss-coeff", "", fields=(_TC + "moe_z_loss_coeff",)),
    Option("--attention-dropout", "", fields=(_TC + "attention_dropout",)),
    Option("--hidden-dropout", "", fields=(_TC + "hidden_dropout",)),
    Option(
        "--attention-softmax-in-fp32",
        "off without it, as in Megatron-LM",
        fields=(_TC + "attention_softmax_in_fp32",),
    ),
    Option("--recompute-granularity", "full or selective", fields=(_TC + "recompute_granularity",)),
    Option("--recompute-method", "", ("--recompute-granularity",), fields=(_TC + "recompute_method",)),
    Option("--recompute-num-layers", "", ("--recompute-method",), fields=(_TC + "recompute_num_layers",)),
    Option("--recompute-modules", "", ("--recompute-granularity",), fields=(_TC + "recompute_modules",)),
    # Megatron-LM turns these fusions on by default (its arguments.py leaves them out of the
    # dataclass defaults); they are TE's, Apex's or Megatron-LM's kernels, so the stand-in spec
    # runs unfused, and TE's spec runs each only where what it needs imports (miles.megatron.fusions)
    *(Option(f.flag, _FUSED, fields=(_TC + f.field,)) for f in FUSIONS),
    Option(
        "--use-flash-attn",
        "",
        refused="megatron-core's models do not read it (Megatron-LM reads it only in its legacy model); "
        "use --attention-backend flash",
    ),
)


def transformer_fields(
    megatron, impl: str, imports: Callable[[str], bool] = module_imports
) -> dict[str, Any]:
    """The TransformerConfig fields the `megatron` section (miles.train.config.MegatronConfig)
    sets, for spec `impl` ("transformer_engine" or "local"); the attention backend is an
    AttnBackend member's name (the caller converts it). A fusion is on with TE's spec where
    every module it runs imports (`imports(name)`, tried for real by default)."""
    out: dict[str, Any] = {}
    if megatron.attention_backend:
        out["attention_backend"] = megatron.attention_backend
    if megatron.moe_grouped_gemm:
        out["moe_grouped_gemm"] = True
    if megatron.moe_permute_fusion:
        out["moe_permute_fusion"] = True
    if megatron.moe_token_dispatcher_type:
        out["moe_token_dispatcher_type"] = megatron.moe_token_dispatcher_type
    if megatron.moe_router_dtype:
        out["moe_router_dtype"] = megatron.moe_router_dtype
    if megatron.moe_router_load_balancing_type:
        out["moe_router_load_balancing_type"] = megatron.moe_router_load_balancing_type
    if megatron.moe_aux_loss_coeff is not None:
        out["moe_aux_loss_coeff"] = megatron.moe_aux_loss_coeff
        if megatron.moe_aux_loss_coeff:
            out.setdefault("moe_router_load_balancing_type", "aux_loss")
    numbers = {
        "moe_router_bias_update_rate": megatron.moe_router_bias_update_rate,
        "moe_z_loss_coeff": megatron.moe_z_loss_coeff,
        "attention_dropout": megatron.attention_dropout,
        "hidden_dropout": megatron.hidden_dropout,
    }
    out.update({name: value for name, value in numbers.items() if value is not None})
    out["attention_softmax_in_fp32"] = bool(megatron.attention_softmax_in_fp32)
    if megatron.recompute_granularity:
        out["recompute_granularity"] = megatron.recompute_granularity
        if megatron.recompute_method:
            out["recompute_method"] = megatron.recompute_method
            out["recompute_num_layers"] = megatron.recompute_num_layers or 1
        if megatron.recompute_modules:
            out["recompute_modules"] = list(megatron.recompute_modules)
    # each --no-<fusion> turns its TransformerConfig field off; the stand-in spec has none of them
    off = {  # each fusion's --no-<fusion> flag (miles.megatron.fusions.FUSIONS names the same pairs)
        "apply_rope_fusion": megatron.no_rope_fusion,
        "bias_dropout_fusion": megatron.no_bias_dropout_fusion,
        "masked_softmax_fusion": megatron.no_masked_softmax_fusion,
        "bias_activation_fusion": megatron.no_bias_swiglu_fusion,
        "gradient_accumulation_fusion": megatron.no_gradient_accumulation_fusion,
    }
    out.update(fusion_fields({field: bool(value) for field, value in off.items()}, impl, imports))
    return out


# --- DistributedDataParallelConfig -----------------------------------------------------------

_DDP, _OPT = "DistributedDataParallelConfig.", "OptimizerConfig."

DDP = (
    Option("--overlap-grad-reduce", "bucketed, asynchronous", fields=(_DDP + "overlap_grad_reduce",)),
    Option(
        "--overlap-param-gather",
        "the weights are gathered before every export to the engine, save, or logprob pass",
        ("--overlap-grad-reduce",),
        fields=(_DDP + "overlap_param_gather", _OPT + "overlap_param_gather"),
    ),
    Option("--accumulate-allreduce-grads-in-fp32", "", fields=(_DDP + "grad_reduce_in_fp32",)),
    Option(
        "--use-distributed-optimizer",
        "always on: fp32 main parameters and Adam states sharded over data parallel (the backend builds no "
        "other optimizer, so the flag asks for what it does anyway)",
        fields=(_DDP + "use_distributed_optimizer", _OPT + "use_distributed_optimizer"),
    ),
)


def ddp_fields(megatron) -> dict[str, Any]:
    """The DistributedDataParallelConfig fields the `megatron` section sets."""
    return {
        "use_distributed_optimizer": distributed_optimizer(megatron),
        "grad_reduce_in_fp32": bool(megatron.accumulate_allreduce_grads_in_fp32),
        "overlap_grad_reduce": bool(megatron.overlap_grad_reduce),
        "overlap_param_gather": bool(megatron.overlap_param_gather),
    }


def distributed_optimizer(megatron) -> bool:
    """Always True, as in the seed framework: radixark/miles sets use_distributed_optimizer for
    every Adam run whatever the command line says (set_default_megatron_args in
    miles/backends/megatron_utils/arguments.py at 31f1ca961a94), so its recipes pass
    --use-precision-aware-optimizer, which megatron-core allows only with the distributed
    optimizer, without the flag. --use-distributed-optimizer asks for what the backend builds;
    leaving it out builds the same (the checkpoints and the data-parallel resharding on resume
    are the distributed optimizer's)."""
    return bool(megatron.use_distributed_optimizer) or True


# --- OptimizerConfig -------------------------------------------------------------------------

OPTIMIZER = (
    # megatron-core 0.16.1 checks TE's version for it (OptimizerConfig.__post_init__), offloaded or not
    Option(
        "--use-precision-aware-optimizer",
        "TE's FusedAdam (or, offloaded, the hybrid optimizer) keeps fp32 main parameters and states",
        (TE,),
        fields=(_OPT + "use_precision_aware_optimizer",),
    ),
    Option(
        "--optimizer-cpu-offload",
        "with Megatron-LM's offload fraction 1.0 (megatron-core's 0.0 offloads nothing): the optimizer steps "
        "in host memory",
        (GPU, "--use-precision-aware-optimizer"),
        fields=(_OPT + "optimizer_cpu_offload", _OPT + "optimizer_offload_fraction"),
    ),
    Option(
        "--overlap-cpu-optimizer-d2h-h2d",
        "host-device copies on side streams",
        (GPU, "--optimizer-cpu-offload"),
        fields=(_OPT + "overlap_cpu_optimizer_d2h_h2d",),
    ),
)


def optimizer_fields(megatron) -> dict[str, Any]:
    """The OptimizerConfig fields the `megatron` section sets (beyond the optimizer's own
    hyperparameters)."""
    out: dict[str, Any] = {
        "overlap_param_gather": bool(megatron.overlap_param_gather),
        "use_distributed_optimizer": distributed_optimizer(megatron),
    }
    if megatron.use_precision_aware_optimizer:
        out["use_precision_aware_optimizer"] = True
    if megatron.optimizer_cpu_offload:
        out.update(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    if megatron.overlap_cpu_optimizer_d2h_h2d:
        out["overlap_cpu_optimizer_d2h_h2d"] = True
    return out


# --- the model built from config.json -----------------------------------------------------

_MISSING = object()


def _field(name: str, expected: Callable[[Any], Any] = lambda v: v) -> Callable:
    def check(value, tc, vocab, position="rope") -> str | None:
        found = getattr(tc, name, _MISSING)
        want = expected(value)
        if found is _MISSING:
            return f"the model config.json describes has no {name} (it would be {want!r})"
        return None if found == want else f"config.json gives {name}={found!r}, the flag says {want!r}"

    return check


def _rotary(value, tc, vocab, position="rope") -> str | None:
    """--position-embedding-type (or --use-rotary-position-embeddings, which means rope) against
    the position embedding the family's mapping builds (`position`: rope, or none for a model
    whose layers carry position themselves)."""
    given = "rope" if value is True else value
    if given == position:
        return None
    built = "rotary position embeddings (rope)" if position == "rope" else f"position embedding {position!r}"
    return f"miles builds {built} for this model, not {value!r}"


def _rotary_percent(value, tc, vocab, position="rope") -> str | None:
    """Only MLA's TransformerConfig has rotary_percent; every other model is a GPTModel miles
    builds without the argument, so with its default, rope over the whole head (1.0)."""
    built = float(getattr(tc, "rotary_percent", 1.0))
    return (
        None
        if built == float(value)
        else f"miles builds rotary_percent={built!r}, the flag says {float(value)!r}"
    )


def _vocab_multiple(value, tc, vocab, position="rope") -> str | None:
    if vocab % int(value) == 0:
        return None
    return f"the checkpoint's embedding has {vocab} rows, not a multiple of {value}; convert it with that multiple"


# flag -> its check against the TransformerConfig built from config.json (None: agrees)
MODEL_CHECKS: Mapping[str, Callable] = {
    "--normalization": _field("normalization"),
    "--qk-layernorm": _field("qk_layernorm", bool),
    "--add-qkv-bias": _field("add_qkv_bias", bool),
    "--position-embedding-type": _rotary,
    "--use-rotary-position-embeddings": _rotary,
    "--rotary-percent": _rotary_percent,
    "--multi-latent-attention": _field("multi_latent_attention", bool),
    "--experimental-attention-variant": _field("experimental_attention_variant"),
    "--moe-router-enable-expert-bias": _field("moe_router_enable_expert_bias", bool),
    "--beta-fast": _field("beta_fast", float),
    "--beta-slow": _field("beta_slow", float),
    "--mscale": _field("mscale", float),
    "--mscale-all-dim": _field("mscale_all_dim", float),
    "--original-max-position-embeddings": _field("original_max_position_embeddings", int),
    "--make-vocab-size-divisible-by": _vocab_multiple,
}

MODEL = (
    *(Option(flag, "checked against the model built from config.json") for flag in MODEL_CHECKS),
    Option(
        "--group-query-attention",
        "with --num-query-groups, checked against config.json's num_key_value_heads",
    ),
    Option("--no-position-embedding", "no learned absolute position embedding, which miles never builds"),
)


def model_disagreements(model, tc, vocab: int, position: str = "rope") -> list[str]:
    """'flag: why' for each MODEL_CHECKS flag the `model` section (miles.train.config.ModelConfig)
    sets that the built model `tc` (with `vocab` embedding rows, `position` embedding) contradicts."""
    out = []
    for flag, check in MODEL_CHECKS.items():
        value = getattr(model, flag.lstrip("-").replace("-", "_"), None)
        if value in (None, False):
            continue
        problem = check(value, tc, vocab, position)
        if problem:
            out.append(f"{flag} {value}: {problem}" if value is not True else f"{flag}: {problem}")
    return out


# --- the layout and the checkpoint ----------------------------------------------------------

ELSEWHERE = (
    Option(
        "--num-layers-per-virtual-pipeline-stage",
        "the layout's virtual pipeline (miles.parallel.ParallelLayout)",
    ),
    Option(
        "--dist-ckpt-optim-fully-reshardable",
        "the distributed optimizer's state is saved in megatron-core's fully_reshardable format (gathered on "
        "data-parallel rank 0, one tensor per parameter), which loads at another TP, PP or EP layout; "
        "without it, dp_reshardable (its own buffers, loads at another data-parallel size only)",
    ),
    Option(
        "--enable-mtp-training",
        "the carried MTP block runs in the training forward and its loss joins the RL loss, its gradient "
        "reaching the MTP parameters alone (miles.megatron.mtp); refused where the backend cannot (PP, CP, "
        "LoRA, a family without DeepSeek-V3-style MTP layers)",
    ),
    Option(
        "--mtp-loss-scaling-factor",
        "the weight of the MTP layers' mean token loss in the training loss",
        needs=("--enable-mtp-training",),
    ),
    Option(
        "--mtp-only-training",
        "every parameter outside the MTP block frozen before DDP and the optimizer are built",
        needs=("--enable-mtp-training",),
    ),
    Option(
        "--megatron-to-hf-mode",
        "raw: the weights come from the torch_dist checkpoint --ref-load names; bridge is refused when the "
        "backend starts (Megatron-Bridge is not part of miles)",
    ),
)

OPTIONS: tuple[Option, ...] = (*SPEC, *TRANSFORMER, *DDP, *OPTIMIZER, *MODEL, *ELSEWHERE)
BY_FLAG: Mapping[str, Option] = {o.flag: o for o in OPTIONS}


def _problem(flag: str, value, given: Mapping[str, Any], te: bool | None, gpu: bool | None) -> str | None:
    """Why `flag` (given with `value`, among `given`) cannot act, if it cannot; `te`/`gpu`:
    whether TE's spec / a GPU are there (None: not known yet)."""
    option = BY_FLAG[flag]
    if option.refused:
        return option.refused
    for need in option.needs:
        alternatives = need.split("|")
        if any(_met(a, given, te, gpu) for a in alternatives):
            continue
        return f"needs {' or '.join(_describe(a) for a in alternatives)}"
    if flag == "--attention-backend" and value in TE_ATTENTION and te is False:
        return f"'{value}' selects a kernel of Transformer Engine's attention; needs {_describe(TE)}"
    if flag == "--attention-backend" and value == "local" and te is True:
        return "'local' is megatron-core's own attention: pass --transformer-impl local with it (as Megatron-LM asks)"
    if flag == "--transformer-impl" and value == "transformer_engine" and (te is False or gpu is False):
        return f"needs {_describe(TE)}"
    if flag == "--recompute-method" and given.get("--recompute-granularity") == "selective":
        return "selective recomputation takes no method (Megatron-LM refuses the pair)"
    return None


def _met(need: str, given: Mapping[str, Any], te: bool | None, gpu: bool | None) -> bool:
    if need == TE:
        return te is not False
    if need == GPU:
        return gpu is not False
    return given.get(need) not in (None, False)


def _describe(need: str) -> str:
    if need == TE:
        return "Transformer Engine's layer spec (TE installed, a GPU)"
    if need == GPU:
        return "a GPU"
    return need


def _given(argv: Sequence[str]) -> dict[str, Any]:
    """flag -> value (True for a switch, a tuple for several values) of an argv; the last wins."""
    out: dict[str, Any] = {}
    flag = None
    for token in argv:
        if token.startswith("--"):
            flag, _, inline = token.partition("=")
            out[flag] = inline if inline else True
        elif flag is not None:
            value = out[flag]
            out[flag] = (
                token if value is True else (*value, token) if isinstance(value, tuple) else (value, token)
            )
    return out


def _problems(given: Mapping[str, Any], te: bool | None, gpu: bool | None) -> list[tuple[str, str]]:
    """(flag, why) for each row's flag among `given` that is refused or whose needs are not met."""
    out = []
    for flag, value in given.items():
        if flag in BY_FLAG:
            problem = _problem(flag, value, given, te=te, gpu=gpu)
            if problem:
                out.append((flag, problem))
    return out


def render_problems(argv: Sequence[str], platform: str, stack_has_te: bool) -> list[tuple[str, str]]:
    """(flag, why) for every flag of a Megatron command (`argv`, the trainer's flags) that the
    backend refuses, or that cannot act on `platform` (whose pinned stack carries TE or not)."""
    given = _given(argv)
    gpu = platform != "cpu"
    te = stack_has_te and gpu and given.get("--transformer-impl") != "local"
    return [
        (flag, f"--train-backend megatron cannot act on it: {why}")
        for flag, why in _problems(given, te=te, gpu=gpu)
    ]


def start_problems(given: Mapping[str, Any], impl: str, device: str) -> list[str]:
    """'flag: why' for every flag the command sets (`given`: option string -> value, the flags
    of the sections the backend takes that differ from their defaults) that the Megatron backend
    refuses, or cannot act on with spec `impl` on `device`."""
    te, gpu = impl == "transformer_engine", device != "cpu"
    return [
        f"{flag}{'' if given[flag] is True else f' {given[flag]}'}: {why}"
        for flag, why in _problems(given, te=te, gpu=gpu)
    ]
