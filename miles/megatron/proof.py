"""Prove layout verdicts with megatron-core itself, on the CPU, under gloo.

`prove(cases)` starts one helper process that imports megatron-core once and, for each world
size, forks that many ranks joined in a gloo process group. Every rank tries every layout of
its world size in turn, the way a training start meets them: `initialize_model_parallel`
(the rank grids and virtual pipeline, called as the trainer calls it:
`miles.megatron.training.init_parallel_state`), `TransformerConfig` (the model config checks, with the layout's
`transformer_config_kwargs`),
`get_num_layers_to_build` for every pipeline stage and virtual stage, for a model whose DSA
layers share their top-k the check miles' GLM model makes of every model chunk's first layer
(`miles.megatron.blocks.check_chunk_start`, on megatron-core's own layer offsets), a MoE layer built on
the expert groups, the check miles' trainer makes of its expert weights' reduction marks
(`miles.megatron.training.check_expert_replicas`), and that layer's training forward called without input (its first
statement checks the layout; the missing input then stops it before any computation); then
`destroy_model_parallel` before the next layout. megatron-core's verdict and exact message
come back as `MegatronVerdict`s.

The model is the recipe's, as far as layouts depend on it: bias-free linear layers unless
the shape says `bias`, the all-to-all token dispatcher, and sequence parallel as Megatron-LM
hands it on (off when tp=1). Widths are tiny: only divisibility matters, and an expert's FFN
width keeps its remainder modulo etp.

The caller never imports megatron-core or torch: only the helper (miles.megatron.ranks) does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from miles.parallel.layout import ModelShape, ParallelLayout
from miles.parallel.verdict import Verdict

FAMILY_STAGE = "the family's model (miles.families)"  # what a family's own modules support
STAGES = (
    "initialize_model_parallel", "TransformerConfig", "get_num_layers_to_build", "miles.megatron.blocks", "VocabParallelEmbedding", FAMILY_STAGE, "MoELayer",
    "miles.megatron.training", "MoELayer.forward",
)  # fmt: skip
# Every rank is a forked process holding torch and megatron-core; past this many the proof
# would take the machine, so bigger worlds are refused with the reason.
MAX_RANKS = 32
MAX_RANKS_ENV = "MILES_MEGATRON_PROOF_MAX_RANKS"

# Which rule a megatron-core failure corresponds to: (stage, pattern in its message, rule id).
_MEGATRON_RULES = (
    ("initialize_model_parallel", r"expert_tensor_model_pipeline_parallel", "expert-grid"),
    ("initialize_model_parallel", r"world_size \(\d+\) is not divisible by \d+$", "dense-grid"),
    ("initialize_model_parallel", r"greater than 1 with interleaved schedule", "vpp-needs-pp"),
    ("TransformerConfig", r"num_attention_heads .* tensor_model_parallel_size", "heads-tp"),
    ("TransformerConfig", r"num_query_groups .* tensor_model_parallel_size", "kv-heads-tp"),
    ("TransformerConfig", r"num_moe_experts must be non None to use expert-parallel", "ep-needs-moe"),
    ("TransformerConfig", r"pipeline stage|middle (layers|stage|pipeline)|virtual ?pipeline", "stage-layers"),
    ("TransformerConfig", r"Bias in Moe is only supported when ETP==1", "moe-bias-etp"),
    ("TransformerConfig", r"DSAttention", "dsa-cp"),
    ("get_num_layers_to_build", r"uneven pipelineing", "stage-layers"),
    (
        "get_num_layers_to_build",
        r"num_layers should be divisible by pipeline_model_parallel_size",
        "layers-pp",
    ),
    ("get_num_layers_to_build", r"should be divisible by vp_size", "vpp-layers"),
    ("miles.megatron.blocks", r"reuses the DSA top-k of an earlier layer", "dsa-index-share-stage"),
    ("VocabParallelEmbedding", r"is not divisible by", "vocab-tp"),
    (FAMILY_STAGE, r"^\w+: --context-parallel-size \d+:", "family-cp"),
    (FAMILY_STAGE, r"^\w+: --tensor-model-parallel-size \d+ does not divide", "family-tp"),
    ("MoELayer", r"num_moe_experts % ep_size", "experts-ep"),
    ("MoELayer", r"is not divisible by", "moe-ffn-etp"),
    ("miles.megatron.training", r"the copies would drift apart", "expert-copies-tp"),
    ("MoELayer.forward", r"MoE and tensor parallelism", "moe-tp-needs-sp"),
)


@dataclass(frozen=True)
class Case:
    layout: ParallelLayout
    world_size: int
    model: ModelShape | None = None

    def to_json(self) -> dict:
        return {
            "layout": self.layout.to_json(),
            "world_size": self.world_size,
            "model": self.model.to_json() if self.model else None,
        }


@dataclass(frozen=True)
class MegatronVerdict:
    ok: bool
    stage: str | None = None  # the megatron-core call that refused the layout
    error: str | None = None  # "<ExceptionType>: <megatron-core's message>"
    layers_per_stage: tuple[int, ...] | None = None
    groups: dict = field(default_factory=dict)  # name -> sorted rank groups, from every rank

    @property
    def rule(self) -> str | None:
        """The miles rule id megatron-core's failure corresponds to (None when ok or unknown)."""
        if self.ok:
            return None
        for stage, pattern, rule in _MEGATRON_RULES:
            if stage == self.stage and re.search(pattern, self.error or ""):
                return rule
        return None

    def agrees_with(self, verdict: Verdict) -> bool:
        if verdict.ok or self.ok:
            return verdict.ok == self.ok
        return verdict.violations[0].rule == self.rule

    def summary(self) -> str:
        if self.ok:
            return "accepted"
        return f"{self.stage}: {self.error}"


class ProofError(RuntimeError):
    """megatron-core could not be run (not installed, a rank died or hung)."""


class ProofTooLarge(ValueError):
    """A world size above the cap on forked gloo ranks."""


def max_ranks(env: Mapping[str, str] = os.environ) -> int:
    raw = env.get(MAX_RANKS_ENV, "").strip()
    if not raw:
        return MAX_RANKS
    if not raw.isdigit() or int(raw) < 1:
        raise ProofTooLarge(f"{MAX_RANKS_ENV}={raw!r} is not a positive rank count")
    return int(raw)


def check_proof_size(world_size: int, env: Mapping[str, str] = os.environ) -> None:
    """Refuse, with the reason and the way out, a proof that would fork too many ranks."""
    cap = max_ranks(env)
    if world_size > cap:
        raise ProofTooLarge(
            f"--megatron forks one gloo process per rank, and world size {world_size} is above the cap of "
            f"{cap} ({MAX_RANKS_ENV} raises it); the layout rules need no proof to run, or prove a "
            "smaller world with the same factors"
        )


def prove(cases: Sequence[Case], timeout_s: float | None = None) -> list[MegatronVerdict]:
    """megatron-core's verdict on each case, in order (one helper process for all of them).

    `timeout_s` bounds the whole proof (default: 5 minutes plus 10 s per layout); a rank that
    makes no progress for 2 minutes stops it sooner."""
    for world in sorted({c.world_size for c in cases}):
        check_proof_size(world)
    if timeout_s is None:
        timeout_s = 300 + 10 * len(cases)
    with tempfile.TemporaryDirectory(prefix="miles-megatron-") as tmp:
        inp, out = Path(tmp, "cases.json"), Path(tmp, "verdicts.json")
        inp.write_text(json.dumps([c.to_json() for c in cases]))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "miles.megatron.ranks", str(inp), str(out)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ProofError(
                f"megatron-core proof of {len(cases)} layout(s) did not finish in {timeout_s:g} s"
            ) from None
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            raise ProofError(f"megatron-core proof failed (exit {proc.returncode}):\n" + "\n".join(tail))
        raw = json.loads(out.read_text())
    return [_verdict(r) for r in raw]


def _verdict(r: dict) -> MegatronVerdict:
    layers = r.get("layers_per_stage")
    return MegatronVerdict(
        ok=r["ok"],
        stage=r.get("stage"),
        error=r.get("error"),
        layers_per_stage=tuple(layers) if layers is not None else None,
        groups={k: [list(g) for g in v] for k, v in (r.get("groups") or {}).items()},
    )


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "not installed"
