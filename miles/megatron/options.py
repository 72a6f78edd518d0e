"""What the Megatron backend does with each Megatron and GPU-stack flag: one declaration per flag.

Every flag of `python -m miles.train`'s Megatron group, and every GPU-stack flag, that the
Megatron backend acts on has one `Option` row here, in the section of the function that wires
it: the spec choice, a megatron-core TransformerConfig field (`transformer_fields`), a
DistributedDataParallelConfig or OptimizerConfig field (`ddp_fields`, `optimizer_fields`), a
check against the model built from config.json (`model_disagreements`; the shape flags of
the family facts tables are checked by `check_model_flags`), the layout, the checkpoint or the
rollout engine. A row says what the flag needs (Transformer Engine's layer spec, a GPU,
another flag) or why it is refused. Nothing reaches megatron-core except through these
functions, and any flag of those groups without a row (or with a refusal) is refused: at
render time for a recipe (`render_problems`, miles.recipes.stack) and when the backend starts
(`start_problems`). Standard library only: the render reads it without torch. The module is
long because it is the one table; each function sits beside the rows it reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TE = "te"  # needs megatron-core's Transformer Engine layer spec (TE installed, on a GPU)
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
    # dataclass defaults); they are TE's or Apex's kernels, so the stand-in spec runs unfused.
    Option("--no-rope-fusion", "off; on with the TE spec otherwise", fields=(_TC + "apply_rope_fusion",)),
    Option(
        "--no-bias-dropout-fusion",
        "off; on with the TE spec otherwise",
        fields=(_TC + "bias_dropout_fusion",),
    ),
    Option(
        "--no-masked-softmax-fusion",
        "off; on with the TE spec otherwise",
        fields=(_TC + "masked_softmax_fusion",),
    ),
    Option(
        "--no-bias-swiglu-fusion",
        "off; on with the TE spec otherwise",
        fields=(_TC + "bias_activation_fusion",),
    ),
    Option(
        "--no-gradient-accumulation-fusion",
        "off; on with the TE spec otherwise",
        fields=(_TC + "gradient_accumulation_fusion",),
    ),
    Option(
        "--use-flash-attn",
        "",
        refused="megatron-core's models do not read it (Megatron-LM reads it only in its legacy model); "
        "use --attention-backend flash",
    ),
)

_FUSIONS = {  # flag dest -> TransformerConfig field it turns off
    "no_rope_fusion": "apply_rope_fusion",
    "no_bias_dropout_fusion": "bias_dropout_fusion",
    "no_masked_softmax_fusion": "masked_softmax_fusion",
    "no_bias_swiglu_fusion": "bias_activation_fusion",
    "no_gradient_accumulation_fusion": "gradient_accumulation_fusion",
}


def transformer_fields(args, impl: str) -> dict[str, Any]:
    """The TransformerConfig fields the flags set, for spec `impl` ("transformer_engine" or
    "local"); the attention backend is an AttnBackend member's name (the caller converts it)."""
    te = impl == "transformer_engine"
    out: dict[str, Any] = {}
    if args.attention_backend:
        out["attention_backend"] = args.attention_backend
    if args.moe_grouped_gemm:
        out["moe_grouped_gemm"] = True
    if args.moe_permute_fusion:
        out["moe_permute_fusion"] = True
    for name in ("moe_token_dispatcher_type", "moe_router_dtype", "moe_router_load_balancing_type"):
        if getattr(args, name):
            out[name] = getattr(args, name)
    if args.moe_aux_loss_coeff is not None:
        out["moe_aux_loss_coeff"] = args.moe_aux_loss_coeff
        if args.moe_aux_loss_coeff:
            out.setdefault("moe_router_load_balancing_type", "aux_loss")
    for name in ("moe_router_bias_update_rate", "moe_z_loss_coeff", "attention_dropout", "hidden_dropout"):
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    out["attention_softmax_in_fp32"] = bool(args.attention_softmax_in_fp32)
    if args.recompute_granularity:
        out["recompute_granularity"] = args.recompute_granularity
        if args.recompute_method:
            out["recompute_method"] = args.recompute_method
            out["recompute_num_layers"] = args.recompute_num_layers or 1
        if args.recompute_modules:
            out["recompute_modules"] = list(args.recompute_modules)
    for dest, field in _FUSIONS.items():
        out[field] = te and not getattr(args, dest)
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
        "which miles always uses",
        fields=(_DDP + "use_distributed_optimizer", _OPT + "use_distributed_optimizer"),
    ),
)


def ddp_fields(args) -> dict[str, Any]:
    """The DistributedDataParallelConfig fields the flags set."""
    return {
        "grad_reduce_in_fp32": bool(args.accumulate_allreduce_grads_in_fp32),
        "overlap_grad_reduce": bool(args.overlap_grad_reduce),
        "overlap_param_gather": bool(args.overlap_param_gather),
        "use_distributed_optimizer": True,
    }


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


def optimizer_fields(args) -> dict[str, Any]:
    """The OptimizerConfig fields the flags set (beyond the optimizer's own hyperparameters)."""
    out: dict[str, Any] = {
        "use_distributed_optimizer": True,
        "overlap_param_gather": bool(args.overlap_param_gather),
    }
    if args.use_precision_aware_optimizer:
        out["use_precision_aware_optimizer"] = True
    if args.optimizer_cpu_offload:
        out.update(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    if args.overlap_cpu_optimizer_d2h_h2d:
        out["overlap_cpu_optimizer_d2h_h2d"] = True
    return out


# --- the model built from config.json -----------------------------------------------------

_MISSING = object()


def _field(name: str, expected: Callable[[Any], Any] = lambda v: v) -> Callable:
    def check(value, tc, vocab) -> str | None:
        found = getattr(tc, name, _MISSING)
        want = expected(value)
        if found is _MISSING:
            return f"the model config.json describes has no {name} (it would be {want!r})"
        return None if found == want else f"config.json gives {name}={found!r}, the flag says {want!r}"

    return check


def _rotary(value, tc, vocab) -> str | None:
    return (
        None if value in (True, "rope") else f"miles builds rotary position embeddings (rope), not {value!r}"
    )


def _vocab_multiple(value, tc, vocab) -> str | None:
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
    "--rotary-percent": _field("rotary_percent", float),
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


def family_flags() -> frozenset[str]:
    """The shape flags every family's facts table checks against config.json (check_model_flags)."""
    from miles.models import ANY_FAMILY

    return frozenset(row.flag for row in ANY_FAMILY)


def model_disagreements(args, tc, vocab: int) -> list[str]:
    """'flag: why' for each given MODEL_CHECKS flag the built model contradicts."""
    out = []
    for flag, check in MODEL_CHECKS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value in (None, False):
            continue
        problem = check(value, tc, vocab)
        if problem:
            out.append(f"{flag} {value}: {problem}" if value is not True else f"{flag}: {problem}")
    return out


# --- layout, checkpoint, rollout engine, and what no part of the backend does --------------

ELSEWHERE = (
    Option(
        "--num-layers-per-virtual-pipeline-stage",
        "the layout's virtual pipeline (miles.parallel.ParallelLayout)",
    ),
    Option(
        "--megatron-to-hf-mode",
        "raw: the weights come from the torch_dist checkpoint --ref-load names; bridge is refused when the "
        "backend starts (Megatron-Bridge is not part of miles)",
    ),
    Option(
        "--colocate",
        "the placement miles' rollout engines always have: on the training GPUs, released during training",
    ),
    Option(
        "--use-dynamic-batch-size",
        "",
        refused="miles.train forms micro-batches of --micro-batch-size samples; token-budget micro-batches are "
        "not implemented",
    ),
    Option(
        "--max-tokens-per-gpu",
        "",
        refused="it sizes token-budget micro-batches (--use-dynamic-batch-size), which miles.train does not form; "
        "set --micro-batch-size",
    ),
    Option(
        "--balance-data",
        "",
        refused="miles.train splits each minibatch over data-parallel ranks by sample, strided; balancing ranks "
        "by token count is not implemented",
    ),
)

OPTIONS: tuple[Option, ...] = (*SPEC, *TRANSFORMER, *DDP, *OPTIMIZER, *MODEL, *ELSEWHERE)
BY_FLAG: Mapping[str, Option] = {o.flag: o for o in OPTIONS}


@functools.cache
def scope() -> dict[str, str]:
    """Every flag (option string -> dest) this table answers for: the trainer's Megatron group and
    its GPU-stack flags (miles.train.args)."""
    from miles.train.args import GPU_STACK_ONLY, MEGATRON_GROUP, build_parser

    parser = build_parser()
    megatron = {a.dest for g in parser._action_groups if g.title == MEGATRON_GROUP for a in g._group_actions}
    return {
        a.option_strings[0]: a.dest
        for a in parser._actions
        if a.option_strings and (a.dest in megatron or a.dest in GPU_STACK_ONLY)
    }


def _problem(flag: str, value, given: Mapping[str, Any], te: bool | None, gpu: bool | None) -> str | None:
    """Why `flag` (given with `value`, among `given`) has no effect or cannot act, if it cannot;
    `te`/`gpu`: whether TE's spec / a GPU are there (None: not known yet)."""
    option = BY_FLAG.get(flag)
    if option is None:
        if flag in family_flags():
            return None
        return "python -m miles.train parses it (a Megatron-LM flag) but no part of the Megatron backend acts on it"
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


def render_problems(argv: Sequence[str], platform: str, stack_has_te: bool) -> list[tuple[str, str]]:
    """(flag, why) for every flag of a Megatron command (`argv`, the trainer's flags) that would be
    accepted and do nothing, or cannot act on `platform` (whose pinned stack carries TE or not)."""
    known = scope()
    given = _given(argv)
    gpu = platform != "cpu"
    te = stack_has_te and gpu and given.get("--transformer-impl") != "local"
    out = []
    for flag, value in given.items():
        if flag not in known:
            continue
        problem = _problem(flag, value, given, te=te, gpu=gpu)
        if problem:
            out.append((flag, f"without effect on --train-backend megatron: {problem}"))
    return out


def start_problems(args, changed: Mapping[str, Any], impl: str, device: str) -> list[str]:
    """'flag: why' for every flag the command sets (`changed`: option string -> value) that the
    Megatron backend would not act on with spec `impl` on `device`."""
    known = scope()
    te, gpu = impl == "transformer_engine", device != "cpu"
    out = []
    for flag, value in changed.items():
        if flag not in known:
            continue
        problem = _problem(flag, value, changed, te=te, gpu=gpu)
        if flag == "--megatron-to-hf-mode" and value == "bridge":
            problem = "Megatron-Bridge is not part of miles; convert the checkpoint to torch_dist (invoke prepare-ckpt)"
        if problem:
            out.append(f"{flag}{'' if value is True else f' {value}'}: {problem}")
    if changed.get("--recompute-method") and changed.get("--recompute-granularity") == "selective":
        out.append(
            "--recompute-method: selective recomputation takes no method (Megatron-LM refuses the pair)"
        )
    return out
