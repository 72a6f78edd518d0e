"""Every Megatron rule that rejects a layout, in the order a training start meets them.

Megatron-LM's argument parsing first (sequence parallel with tp=1 is turned off, not refused),
then megatron-core: `initialize_model_parallel` (rank grids, virtual pipeline), the
`TransformerConfig` checks, the pipeline split (`get_num_layers_to_build`), the MoE layer's
construction, and the first training forward of a MoE layer. So the first violation found
here is the error megatron-core raises first; `miles.megatron.proof` proves that by
running it. Rules whose outcome changed between megatron-core releases take the version.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache

from miles.parallel.layout import ModelShape, ParallelLayout

# megatron-core releases from which DSA attention may use context parallel (all-gather only);
# 0.16.1's TransformerConfig refuses any cp > 1 with DSA.
DSA_CP_ALLGATHER_SINCE = (0, 19)
# Assumed when no megatron-core is installed and none is named: the strictest known rules.
FALLBACK_MEGATRON_CORE = "0.16.1"


def parse_version(text: str) -> tuple[int, ...]:
    """'0.19.2' -> (0, 19, 2); pre-release and local tags ('0.19.0rc1', '+cu13') are dropped."""
    parts = re.findall(r"\d+", text.split("+", 1)[0])[:3]
    if not parts:
        raise ValueError(f"megatron-core version {text!r} is not a version number")
    return tuple(int(p) for p in parts)


@lru_cache(maxsize=1)
def installed_megatron_core() -> str | None:
    """The installed megatron-core's version, read from its metadata (nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Context:
    """What a rule sees besides the layout: the world size, the model and megatron-core's version."""

    world: int
    model: ModelShape | None
    megatron_core: str

    @property
    def version(self) -> tuple[int, ...]:
        return parse_version(self.megatron_core)


Check = Callable[[ParallelLayout, Context], "str | None"]


@dataclass(frozen=True)
class Rule:
    id: str
    stage: str  # where megatron-core (or Megatron-LM) enforces it
    check: Check  # message when violated, else None
    factors: tuple[str, ...]  # the ParallelLayout fields a fix may change, preferred first
    # What a fix achieves for this rule; without one, a fix says whether the whole layout
    # becomes valid.
    outcome: Callable[[ParallelLayout, Context], str] | None = None
    needs_model: bool = False


def _dense_grid(c: ParallelLayout, x: Context) -> str | None:
    if x.world % c.dense_size:
        return f"tp({c.tp})·cp({c.cp})·pp({c.pp}) = {c.dense_size} does not divide world size {x.world}"
    return None


def _vpp_needs_pp(c: ParallelLayout, x: Context) -> str | None:
    if c.vpp is not None and c.pp <= 1:
        return f"virtual pipeline stages (vpp={c.vpp}) interleave pipeline ranks, so they need pp > 1 (pp={c.pp})"
    return None


def _expert_grid(c: ParallelLayout, x: Context) -> str | None:
    if x.world % c.expert_size:
        etp = f"etp({c.expert_tp})" if c.etp is not None else f"etp(= tp, {c.expert_tp})"
        return f"{etp}·ep({c.ep})·pp({c.pp}) = {c.expert_size} does not divide world size {x.world}"
    return None


def _heads_tp(c: ParallelLayout, x: Context) -> str | None:
    m = x.model
    if m.num_attention_heads % c.tp:
        return f"{m.name}: {m.num_attention_heads} attention heads do not split evenly over tp({c.tp})"
    return None


def _kv_heads_tp(c: ParallelLayout, x: Context) -> str | None:
    m = x.model
    kv = m.kv_heads
    if kv % c.tp and c.tp % kv:
        return f"{m.name}: {kv} KV heads (query groups) are neither a multiple nor a divisor of tp({c.tp})"
    return None


def _ep_needs_moe(c: ParallelLayout, x: Context) -> str | None:
    m = x.model
    if c.ep > 1 and not m.moe:
        return f"{m.name} is a dense model (no experts), so ep({c.ep}) must be 1"
    return None


def middle(c: ParallelLayout, m: ModelShape) -> tuple[int, int]:
    """Layers and pipeline stages left between explicit first/last stage sizes."""
    layers, stages = m.num_layers, c.pp
    for given in (c.first_stage_layers, c.last_stage_layers):
        if given is not None:
            layers -= given
            stages -= 1
    return layers, stages


def _stage_layers(c: ParallelLayout, x: Context) -> str | None:
    m = x.model
    if c.first_stage_layers is None and c.last_stage_layers is None:
        return None
    for which, given in (("first", c.first_stage_layers), ("last", c.last_stage_layers)):
        if given is not None and c.vpp is not None and given % c.vpp:
            return f"{m.name}: the {which} stage's {given} layer(s) do not split into vpp({c.vpp}) virtual stages"
    layers, stages = middle(c, m)
    given = f"first stage {c.first_stage_layers}, last stage {c.last_stage_layers}"
    if stages < 0:
        # megatron-core accepts this and builds only the last stage's layers: a silently
        # truncated model. Refuse it here.
        return (
            f"{m.name}: pp({c.pp}) has one stage, which is both first and last, so {given} "
            f"cannot both be set; unset them (the stage holds all {m.num_layers} layers)"
        )
    if bool(layers) != bool(stages):
        return (
            f"{m.name}: {m.num_layers} layers with pp({c.pp}) and {given} leave {layers} layer(s) "
            f"for {stages} middle stage(s); both must be zero or both positive"
        )
    if stages and layers % stages:
        return (
            f"{m.name}: {m.num_layers} layers with pp({c.pp}) and {given} leave {layers} layer(s), "
            f"which do not split evenly over {stages} middle stage(s)"
        )
    if layers < 0:
        # megatron-core accepts this and builds a negative-size middle stage; refuse it here.
        return f"{m.name}: {given} add up to more than its {m.num_layers} layers"
    if stages and c.vpp is not None and (layers // stages) % c.vpp:
        return (
            f"{m.name}: each middle stage's {layers // stages} layer(s) do not split into "
            f"vpp({c.vpp}) virtual stages"
        )
    return None


def _moe_bias_etp(c: ParallelLayout, x: Context) -> str | None:
    m = x.model
    if m.moe and m.bias and c.expert_tp != 1:
        return f"{m.name}: MoE layers with biases (no --disable-bias-linear) need etp = 1, got etp({c.expert_tp})"
    return None


def _dsa_cp(c: ParallelLayout, x: Context) -> str | None:
    m = x.model
    if m.attention != "dsa" or c.cp == 1:
        return None
    if x.version < DSA_CP_ALLGATHER_SINCE:
        return (
            f"{m.name} uses DSA sparse attention, which megatron-core {x.megatron_core} cannot split "
            f"over cp({c.cp}); cp must be 1 (megatron-core 0.19 allows it with all-gather context parallel)"
        )
    if c.cp_comm_type != "all_gather":
        return (
            f"{m.name} uses DSA sparse attention, which megatron-core {x.megatron_core} splits over "
            f"cp({c.cp}) only with all-gather context parallel (cp_comm_type all_gather, not "
            f"{c.cp_comm_type or 'p2p, the default'})"
        )
    return None


def _vocab_tp(c: ParallelLayout, x: Context) -> str | None:
    vocab = x.model.vocab_size
    if vocab is None or vocab % c.tp == 0:
        return None
    return (
        f"{x.model.name}: the vocabulary of {vocab} rows does not split over tp({c.tp}); megatron-core's "
        "vocabulary-parallel embedding and output layer need tp to divide it (checkpoints are converted unpadded)"
    )


def _family_cp(c: ParallelLayout, x: Context) -> str | None:
    problem = x.model.limits.cp_problem(c.cp)
    return f"{x.model.name}: {problem}" if problem else None


def _family_tp(c: ParallelLayout, x: Context) -> str | None:
    problem = x.model.limits.tp_problem(c.tp)
    return f"{x.model.name}: {problem}" if problem else None


def chunk_starts(c: ParallelLayout, m: ModelShape) -> tuple[int, ...]:
    """The first (0-based) layer of every model chunk: pipeline stages, or with vpp the virtual
    stages, in megatron-core's order (virtual stage 0 of every rank, then virtual stage 1, ...)."""
    per_chunk = layers_per_virtual_stage(c, m)
    starts, at = [], 0
    for _ in range(c.vpp or 1):
        for size in per_chunk:
            starts.append(at)
            at += size
    return tuple(starts)


def _index_share_stage(c: ParallelLayout, x: Context) -> str | None:
    m = x.model
    if not m.shared_index_layers or (c.pp == 1 and c.vpp is None):
        return None
    shared = set(m.shared_index_layers)
    bad = [s for s in chunk_starts(c, m) if s in shared]
    if not bad:
        return None
    stage = "virtual stage" if c.vpp is not None else "pipeline stage"
    return (
        f"{m.name}: a {stage} starts at layer {bad[0]}, which reuses the DSA top-k of an earlier layer "
        f"(cross-layer index sharing) held by another stage; every stage must start on a layer that runs "
        f"its own indexer (shared layers: {', '.join(map(str, m.shared_index_layers))})"
    )


def _layers_pp(c: ParallelLayout, x: Context) -> str | None:
    m = x.model
    if c.first_stage_layers is None and c.last_stage_layers is None and m.num_layers % c.pp:
        return f"{m.name}: {m.num_layers} layers do not split evenly over pp({c.pp}) pipeline stages"
    return None


def _vpp_layers(c: ParallelLayout, x: Context) -> str | None:
    m = x.model
    if c.vpp is None or c.pp <= 1 or c.first_stage_layers is not None or c.last_stage_layers is not None:
        return None
    if m.num_layers % c.pp:
        return None  # layers-pp already says so
    per_rank = m.num_layers // c.pp
    if per_rank % c.vpp:
        return (
            f"{m.name}: {m.num_layers} layers over pp({c.pp}) leave {per_rank} per pipeline rank, "
            f"which do not split into vpp({c.vpp}) virtual stages"
        )
    return None


def _experts_ep(c: ParallelLayout, x: Context) -> str | None:
    m = x.model
    if m.moe and m.num_experts % c.ep:
        return f"{m.name}: {m.num_experts} experts do not split evenly over ep({c.ep})"
    return None


def _moe_ffn_etp(c: ParallelLayout, x: Context) -> str | None:
    m = x.model
    if m.moe and m.moe_ffn_hidden_size is not None and m.moe_ffn_hidden_size % c.expert_tp:
        return f"{m.name}: an expert's FFN width {m.moe_ffn_hidden_size} does not split evenly over etp({c.expert_tp})"
    return None


def _expert_copies_tp(c: ParallelLayout, x: Context) -> str | None:
    m = x.model
    if m.moe and c.ep == 1 and c.expert_tp < c.tp and c.effective_sp:
        return (
            f"{m.name}: with ep(1) and etp({c.expert_tp}) < tp({c.tp}) each expert is copied on "
            f"{c.tp // c.expert_tp} ranks of a tensor-parallel group, each trained on its own "
            "sequence-parallel tokens, and megatron-core reduces expert weights over data parallel only "
            "at ep 1: the copies would drift apart"
        )
    return None


def _moe_tp_needs_sp(c: ParallelLayout, x: Context) -> str | None:
    m = x.model
    if m.moe and c.tp > 1 and not c.effective_sp:
        return (
            f"{m.name}: MoE layers with tp({c.tp}) need sequence parallel; megatron-core refuses the "
            "first training forward of a MoE layer without it"
        )
    return None


def split_text(c: ParallelLayout, m: ModelShape) -> str:
    sizes = stage_sizes(c, m)
    if c.first_stage_layers is None and c.last_stage_layers is None:
        text = f"splits {m.num_layers} layers {sizes[0]} per stage"
    else:
        text = f"splits {m.num_layers} layers as {sizes}"
    if c.vpp is not None:
        text += f", {layers_per_virtual_stage(c, m)[0]} per virtual stage"
    return text


RULES: tuple[Rule, ...] = (
    Rule("dense-grid", "initialize_model_parallel", _dense_grid, ("tp", "cp", "pp"), lambda c, x: f"makes tp·cp·pp = {c.dense_size} divide world {x.world}"),
    Rule("vpp-needs-pp", "initialize_model_parallel", _vpp_needs_pp, ("vpp", "pp")),
    Rule("expert-grid", "initialize_model_parallel", _expert_grid, ("ep", "etp", "pp"), lambda c, x: f"makes etp·ep·pp = {c.expert_size} divide world {x.world}"),
    Rule("heads-tp", "TransformerConfig", _heads_tp, ("tp",), lambda c, x: f"splits {x.model.num_attention_heads} heads {x.model.num_attention_heads // c.tp} per tp rank", True),
    Rule("kv-heads-tp", "TransformerConfig", _kv_heads_tp, ("tp",), lambda c, x: f"fits {x.model.kv_heads} KV heads to tp {c.tp}", True),
    Rule("ep-needs-moe", "TransformerConfig", _ep_needs_moe, ("ep",), needs_model=True),
    Rule("stage-layers", "TransformerConfig", _stage_layers, ("first_stage_layers", "last_stage_layers", "pp", "vpp"), needs_model=True),
    Rule("moe-bias-etp", "TransformerConfig", _moe_bias_etp, ("etp",), needs_model=True),
    Rule("dsa-cp", "TransformerConfig", _dsa_cp, ("cp", "cp_comm_type"), needs_model=True),
    Rule("vocab-tp", "VocabParallelEmbedding", _vocab_tp, ("tp",), lambda c, x: f"splits {x.model.vocab_size} rows {x.model.vocab_size // c.tp} per tp rank", True),
    Rule("family-cp", "the family's model (miles.families)", _family_cp, ("cp",), needs_model=True),
    Rule("family-tp", "the family's model (miles.families)", _family_tp, ("tp",), needs_model=True),
    Rule("layers-pp", "get_num_layers_to_build", _layers_pp, ("pp", "first_stage_layers", "last_stage_layers"), lambda c, x: split_text(c, x.model), True),
    Rule("vpp-layers", "get_num_layers_to_build", _vpp_layers, ("vpp", "pp"), lambda c, x: split_text(c, x.model), True),
    # miles' own: megatron-core 0.16.1 has no cross-layer top-k sharing (miles.families.glm_moe_dsa builds it)
    Rule("dsa-index-share-stage", "miles.megatron.blocks", _index_share_stage, ("first_stage_layers", "last_stage_layers", "pp", "vpp"), lambda c, x: split_text(c, x.model), True),
    Rule("experts-ep", "MoELayer", _experts_ep, ("ep",), lambda c, x: f"puts {x.model.num_experts // c.ep} experts on each ep rank", True),
    Rule("moe-ffn-etp", "MoELayer", _moe_ffn_etp, ("etp",), lambda c, x: f"splits each expert's FFN {x.model.moe_ffn_hidden_size // c.expert_tp} per etp rank", True),
    # miles' own: megatron-core accepts the layout and trains the copies apart (miles.megatron.training refuses)
    Rule("expert-copies-tp", "miles.megatron.training", _expert_copies_tp, ("etp", "ep"), needs_model=True),
    Rule("moe-tp-needs-sp", "MoELayer.forward", _moe_tp_needs_sp, ("sp", "tp"), needs_model=True),
)  # fmt: skip
RULE_IDS = tuple(r.id for r in RULES)


def violated(layout: ParallelLayout, context: Context) -> Iterator[tuple[Rule, str]]:
    for rule in RULES:
        if rule.needs_model and context.model is None:
            continue
        message = rule.check(layout, context)
        if message:
            yield rule, message


def stage_sizes(layout: ParallelLayout, model: ModelShape) -> tuple[int, ...]:
    """Layers per pipeline rank, as megatron-core assigns them (assumes a valid layout)."""
    layers, stages = middle(layout, model)
    per_middle = layers // stages if stages else 0
    sizes = [per_middle] * layout.pp
    if layout.first_stage_layers is not None:
        sizes[0] = layout.first_stage_layers
    if layout.last_stage_layers is not None:
        sizes[-1] = layout.last_stage_layers
    return tuple(sizes)


def layers_per_virtual_stage(layout: ParallelLayout, model: ModelShape) -> tuple[int, ...]:
    """Layers in each virtual stage of each pipeline rank (what `get_num_layers_to_build`
    returns per model chunk); equal to `stage_sizes` without interleaving."""
    return tuple(size // (layout.vpp or 1) for size in stage_sizes(layout, model))
