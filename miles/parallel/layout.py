"""The two records every layout rule reads: a `ParallelConfig` and the `ModelShape` it splits."""

from __future__ import annotations

from dataclasses import dataclass, fields

ATTENTION_KINDS = ("gqa", "mla", "dsa")  # dsa: DeepSeek sparse attention (indexer + top-k)
# Megatron-LM's --cp-comm-type values ("allgather" is accepted as a spelling of all_gather).
CP_COMM_TYPES = ("p2p", "a2a", "all_gather", "a2a+p2p")


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron parallel degrees. `etp` (expert tensor parallel) defaults to `tp` when None;
    `vpp` is the number of virtual pipeline stages per pipeline rank (None: not interleaved)."""

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

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def effective_sp(self) -> bool:
        """Sequence parallel as Megatron-LM runs it: with tp=1 it is turned off (with a warning)."""
        return self.sp and self.tp > 1

    @property
    def dense_size(self) -> int:
        """Ranks one replica of the dense (attention) part spans: tp·cp·pp."""
        return self.tp * self.cp * self.pp

    @property
    def expert_size(self) -> int:
        """Ranks one replica of the expert part spans: etp·ep·pp."""
        return self.expert_tp * self.ep * self.pp

    def dp(self, world_size: int) -> int:
        return world_size // self.dense_size

    def expert_dp(self, world_size: int) -> int:
        return world_size // self.expert_size

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

    def trainer_args(self) -> tuple[tuple[str, int | str | bool | None], ...]:
        """The Megatron trainer flags for this layout as (flag, value) pairs, the names
        `python -m miles.train` parses; False or None means the flag is not passed."""
        return (
            ("--tensor-model-parallel-size", self.tp),
            ("--pipeline-model-parallel-size", self.pp),
            ("--context-parallel-size", self.cp),
            ("--cp-comm-type", self.cp_comm_type),
            ("--expert-model-parallel-size", self.ep),
            ("--expert-tensor-parallel-size", self.expert_tp),
            ("--sequence-parallel", self.sp),
            ("--decoder-first-pipeline-num-layers", self.first_stage_layers),
            ("--decoder-last-pipeline-num-layers", self.last_stage_layers),
            ("--num-virtual-stages-per-pipeline-rank", self.vpp),
        )

    def trainer_flags(self) -> tuple[str, ...]:
        """`trainer_args()` as argv tokens."""
        out: list[str] = []
        for flag, value in self.trainer_args():
            if value is True:
                out.append(flag)
            elif value not in (None, False):
                out += [flag, str(value)]
        return tuple(out)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


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

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention {self.attention!r} is not one of {', '.join(ATTENTION_KINDS)}")
        for name in (
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "num_experts",
            "moe_ffn_hidden_size",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{self.name}: {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"{self.name}: bias must be true or false, got {self.bias!r}")

    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def moe(self) -> bool:
        return self.num_experts is not None

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
