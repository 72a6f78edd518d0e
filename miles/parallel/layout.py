"""The parallel layout of a job, and the model shape it splits.

`ParallelLayout` is the one record of the Megatron parallel degrees (tp, pp, vpp, cp, ep, etp,
sp, uneven first/last pipeline stages, the context-parallel communication). It is parsed once
from the trainer's flags (`from_args`, where both virtual-pipeline flags are resolved), and it
is the only place that derives the data-parallel sizes for a world size, that translates the
layout into megatron-core's arguments (`initialize_model_parallel` and the parallel fields of
`TransformerConfig`) and that renders it back into trainer flags. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

ATTENTION_KINDS = ("gqa", "mla", "dsa")  # dsa: DeepSeek sparse attention (indexer + top-k)
# Megatron-LM's --cp-comm-type values ("allgather" is accepted as a spelling of all_gather).
CP_COMM_TYPES = ("p2p", "a2a", "all_gather", "a2a+p2p")

# Each field and the trainer flag that carries it (its argparse dest: the name with underscores).
TRAINER_FLAGS = (
    ("tp", "--tensor-model-parallel-size"),
    ("pp", "--pipeline-model-parallel-size"),
    ("cp", "--context-parallel-size"),
    ("cp_comm_type", "--cp-comm-type"),
    ("ep", "--expert-model-parallel-size"),
    ("etp", "--expert-tensor-parallel-size"),
    ("sp", "--sequence-parallel"),
    ("first_stage_layers", "--decoder-first-pipeline-num-layers"),
    ("last_stage_layers", "--decoder-last-pipeline-num-layers"),
    ("vpp", "--num-virtual-stages-per-pipeline-rank"),
)
# Megatron-LM's other spelling of the virtual pipeline: layers per virtual stage.
LAYERS_PER_VIRTUAL_STAGE_FLAG = "--num-layers-per-virtual-pipeline-stage"


def dest(flag: str) -> str:
    """The argparse attribute of a trainer flag."""
    return flag.lstrip("-").replace("-", "_")


class VirtualPipelineError(ValueError):
    """Virtual pipeline flags that Megatron-LM cannot turn into a vpp degree."""


@dataclass(frozen=True)
class ParallelLayout:
    """Megatron parallel degrees, in one canonical form: `etp` (expert tensor parallel) is None
    when it equals `tp` (Megatron's default), and `vpp`, the virtual pipeline stages per pipeline
    rank, is None when there is no interleaving (one stage per rank, as Megatron-LM reads 1)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sp: bool = False
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers
    vpp: int | None = None  # --num-virtual-stages-per-pipeline-rank
    cp_comm_type: str | None = None  # --cp-comm-type (None: Megatron's default, p2p)

    def __post_init__(self) -> None:
        optional = ("etp", "first_stage_layers", "last_stage_layers", "vpp")
        for name in ("tp", "pp", "cp", "ep", *optional):
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.sp, bool):
            raise ValueError(f"sp must be true or false, got {self.sp!r}")
        if self.cp_comm_type == "allgather":
            object.__setattr__(self, "cp_comm_type", "all_gather")
        if self.cp_comm_type is not None and self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(
                f"cp_comm_type must be one of {', '.join(CP_COMM_TYPES)}, got {self.cp_comm_type!r}"
            )
        if self.etp == self.tp:
            object.__setattr__(self, "etp", None)
        # Megatron-LM's validate_args turns a virtual pipeline of 1 stage per rank into none
        # (NVIDIA/Megatron-LM megatron/training/arguments.py@000c4ac2, both VPP flags).
        if self.vpp == 1:
            object.__setattr__(self, "vpp", None)

    # --- what follows from the degrees ---------------------------------------------------

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def effective_sp(self) -> bool:
        """Sequence parallel as Megatron-LM runs it: with tp=1 it is turned off (with a warning)."""
        return self.sp and self.tp > 1

    @property
    def interleaved(self) -> bool:
        """Whether megatron-core runs the interleaved (virtual pipeline) schedule."""
        return self.vpp is not None

    @property
    def model_chunks(self) -> int:
        """Model chunks each rank holds: one per virtual pipeline stage."""
        return self.vpp or 1

    @property
    def dense_size(self) -> int:
        """Ranks one replica of the dense (attention) part spans: tp·cp·pp."""
        return self.tp * self.cp * self.pp

    @property
    def expert_size(self) -> int:
        """Ranks one replica of the expert part spans: etp·ep·pp."""
        return self.expert_tp * self.ep * self.pp

    def dp(self, world_size: int) -> int:
        """Data-parallel replicas of the dense part on `world_size` ranks: world / (tp·cp·pp).
        Raises `InvalidParallelism` (naming every factor and a value that fits) when it does not divide."""
        self._require_grids(world_size)
        return world_size // self.dense_size

    def expert_dp(self, world_size: int) -> int:
        """Data-parallel replicas of the experts on `world_size` ranks: world / (etp·ep·pp)."""
        self._require_grids(world_size)
        return world_size // self.expert_size

    def _require_grids(self, world_size: int) -> None:
        if world_size % self.dense_size or world_size % self.expert_size:
            from miles.parallel.verdict import InvalidParallelism, validate

            raise InvalidParallelism(validate(self, world_size))

    # --- megatron-core -------------------------------------------------------------------

    def initialize_model_parallel_kwargs(self) -> dict:
        """The layout's arguments of megatron-core's `parallel_state.initialize_model_parallel`."""
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "context_parallel_size": self.cp,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.expert_tp,
        }

    def transformer_config_kwargs(self) -> dict:
        """The parallel fields of megatron-core's `TransformerConfig` for this layout."""
        out = {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "context_parallel_size": self.cp,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.expert_tp,
            # Megatron-LM's argument parsing turns sequence parallel off when tp=1.
            "sequence_parallel": self.effective_sp,
            "num_layers_in_first_pipeline_stage": self.first_stage_layers,
            "num_layers_in_last_pipeline_stage": self.last_stage_layers,
        }
        if self.cp_comm_type is not None:
            out["cp_comm_type"] = self.cp_comm_type
        return out

    # --- the trainer's flags -------------------------------------------------------------

    def trainer_args(self) -> tuple[tuple[str, int | str | bool | None], ...]:
        """The Megatron trainer flags for this layout as (flag, value) pairs, the names
        `python -m miles.train` parses; False or None means the flag is not passed."""
        values = {**{f.name: getattr(self, f.name) for f in fields(self)}, "etp": self.expert_tp}
        return tuple((flag, values[name]) for name, flag in TRAINER_FLAGS)

    def trainer_flags(self) -> tuple[str, ...]:
        """`trainer_args()` as argv tokens."""
        out: list[str] = []
        for flag, value in self.trainer_args():
            if value is True:
                out.append(flag)
            elif value not in (None, False):
                out += [flag, str(value)]
        return tuple(out)

    @classmethod
    def from_args(cls, args, num_layers: int | None = None) -> ParallelLayout:
        """The layout a trainer command asks for (`args`: the parsed flags). `num_layers` is the
        model's depth, needed only to read --num-layers-per-virtual-pipeline-stage.

        Raises `VirtualPipelineError` for virtual pipeline flags Megatron-LM would refuse, and
        ValueError naming the degree that is not a positive integer."""
        given = {name: getattr(args, dest(flag), None) for name, flag in TRAINER_FLAGS if name != "vpp"}
        given = {k: v for k, v in given.items() if v is not None}
        given["sp"] = bool(given.get("sp", False))
        return cls(**given, vpp=virtual_stages(args, num_layers))

    # --- showing it ----------------------------------------------------------------------

    def describe(self) -> str:
        cp = f"cp{self.cp}" + (f"({self.cp_comm_type})" if self.cp_comm_type else "")
        text = f"tp{self.tp}·pp{self.pp}·{cp}·ep{self.ep}·etp{self.expert_tp}"
        if self.sp:
            text += "+sp"
        if self.vpp is not None:
            text += f" vpp{self.vpp}"
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            text += f" stages(first={self.first_stage_layers}, last={self.last_stage_layers})"
        return text

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def virtual_stages(args, num_layers: int | None) -> int | None:
    """Virtual pipeline stages per pipeline rank, from either Megatron-LM flag (the one place
    both are read): --num-virtual-stages-per-pipeline-rank directly, or
    --num-layers-per-virtual-pipeline-stage (layers per pipeline rank / layers per virtual
    stage, even pipelines only). Giving both is refused, as Megatron-LM refuses it."""
    stages = getattr(args, dest(TRAINER_FLAGS[-1][1]), None)
    per_stage = getattr(args, dest(LAYERS_PER_VIRTUAL_STAGE_FLAG), None)
    if per_stage is None:
        return stages
    flag = f"{LAYERS_PER_VIRTUAL_STAGE_FLAG} {per_stage}"
    if stages is not None:
        raise VirtualPipelineError(
            f"{flag} and --num-virtual-stages-per-pipeline-rank {stages} both set the virtual pipeline; give one"
        )
    if (
        getattr(args, "decoder_first_pipeline_num_layers", None) is not None
        or getattr(args, "decoder_last_pipeline_num_layers", None) is not None
    ):
        raise VirtualPipelineError(
            f"{flag} with explicit first/last pipeline stage sizes: Megatron-LM needs "
            "--num-virtual-stages-per-pipeline-rank for an uneven pipeline"
        )
    pp = getattr(args, "pipeline_model_parallel_size", 1)
    if pp <= 1:
        raise VirtualPipelineError(f"{flag} needs --pipeline-model-parallel-size > 1 (got {pp})")
    if num_layers is None:
        where = getattr(args, "hf_checkpoint", None)
        raise VirtualPipelineError(
            f"{flag}: the layer count is unknown (no --num-layers and no num_hidden_layers in "
            f"{where}/config.json); pass --num-layers or --num-virtual-stages-per-pipeline-rank"
        )
    if num_layers % pp:
        raise VirtualPipelineError(f"{flag}: {num_layers} layers do not split evenly over pp({pp})")
    per_rank = num_layers // pp
    if per_rank % per_stage:
        raise VirtualPipelineError(
            f"{flag}: the {per_rank} layers of each pipeline rank do not split into virtual stages of {per_stage}"
        )
    return per_rank // per_stage


@dataclass(frozen=True)
class FamilyLimits:
    """What a model family's own modules support of a layout beyond megatron-core's rules (its
    family says, miles.families): the layout check and the model's build refuse in the same words."""

    # why the family's model cannot split a sequence over context-parallel ranks ("": it can)
    context_parallel: str = ""
    # (config.json key, its value, what splits by it): tensor parallelism must divide each value
    tp_divides: tuple[tuple[str, int, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tp_divides", tuple(tuple(t) for t in self.tp_divides))  # JSON gives lists

    def cp_problem(self, cp: int) -> str | None:
        if cp == 1 or not self.context_parallel:
            return None
        return f"--context-parallel-size {cp}: {self.context_parallel}; use --context-parallel-size 1"

    def tp_problem(self, tp: int) -> str | None:
        for key, value, what in self.tp_divides:
            if value % tp:
                fits = [d for d in range(1, value + 1) if value % d == 0]
                return (
                    f"--tensor-model-parallel-size {tp} does not divide {key} {value}: {what}; pick a "
                    f"tensor-parallel size dividing it ({', '.join(map(str, fits))})"
                )
        return None


@dataclass(frozen=True)
class ModelShape:
    """The facts of a model that parallel layouts depend on."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_query_groups: int | None = None  # KV heads; None = one per attention head
    num_experts: int | None = None  # None = dense
    attention: str = "gqa"
    bias: bool = False  # biases in the linear layers (every recipe model passes --disable-bias-linear)
    moe_ffn_hidden_size: int | None = None  # an expert's FFN width (None: not checked)
    # DSA layers (0-based) that reuse the top-k of the nearest layer below that runs its own
    # indexer (GLM-5's cross-layer sharing); a pipeline (virtual) stage cannot start on one
    shared_index_layers: tuple[int, ...] = ()
    limits: FamilyLimits = FamilyLimits()  # what the family's own modules support
    # rows of the input embedding and output layer (the checkpoint's, converted unpadded); None: not checked
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shared_index_layers", tuple(self.shared_index_layers))  # JSON gives a list
        if isinstance(self.limits, dict):  # JSON
            object.__setattr__(self, "limits", FamilyLimits(**self.limits))
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention {self.attention!r} is not one of {', '.join(ATTENTION_KINDS)}")
        for name in (
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "num_experts",
            "moe_ffn_hidden_size",
            "vocab_size",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{self.name}: {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"{self.name}: bias must be true or false, got {self.bias!r}")
        wrong = [i for i in self.shared_index_layers if not isinstance(i, int) or not 0 < i < self.num_layers]
        if wrong:
            raise ValueError(
                f"{self.name}: shared_index_layers {wrong} are not layers 1..{self.num_layers - 1} "
                "(layer 0 has no layer below it to share with)"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def moe(self) -> bool:
        return self.num_experts is not None

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["limits"] = {f.name: getattr(self.limits, f.name) for f in fields(self.limits)}
        return out
