"""Model specs: each architecture's facts and the Megatron model flags derived from them.

A recipe names a model; `resolve_model()` turns the name into a spec at a depth: an
`-Nlayer` slice by keyword (`Inkling-Small-4layer`), else `MODEL_ARGS_NUM_LAYERS`, else the
full depth. The MoE layer pattern (`--moe-layer-freq`) is regenerated for the chosen depth,
so a slice keeps the model's leading dense layers. `tiny` is a two-layer random checkpoint of
the same family that the CPU lane builds locally and trains with FSDP/DDP.

The shape numbers follow each model's published config.json; the checkpoint pipeline's
validate step compares the downloaded config with the checkpoint before anything trains.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from miles.parallel import ModelShape
from miles.recipes.args import Args

TINY = "tiny"
TINY_LAYERS = 2
DEPTH_ENV = "MODEL_ARGS_NUM_LAYERS"
_SLICE_RE = re.compile(r"^(?P<base>.+)-(?P<layers>\d+)layers?$")


@dataclass(frozen=True)
class ModelSpec:
    """One architecture at full depth."""

    name: str  # e.g. "Qwen3-30B-A3B"
    family: str  # miles.ckpt.plan.FAMILIES
    hf_repo: str  # where the full checkpoint is published
    num_layers: int
    num_attention_heads: int
    num_query_groups: int | None = None  # KV heads; None = MHA (or MLA, where Megatron ignores it)
    num_experts: int | None = None
    first_k_dense: int = 0  # leading dense layers before the MoE layers start
    attention: str = "gqa"  # gqa | mla | dsa
    arch_args: Args = ()  # depth-independent Megatron architecture flags

    def shape(self, num_layers: int | None = None, name: str | None = None) -> ModelShape:
        layers = num_layers or self.num_layers
        name = name or (self.name if layers == self.num_layers else f"{self.name}-{layers}layer")
        return ModelShape(
            name, layers, self.num_attention_heads, self.num_query_groups, self.num_experts, self.attention
        )

    def model_args(self, num_layers: int | None = None) -> Args:
        """Megatron model flags at `num_layers` (full depth when None)."""
        layers = num_layers or self.num_layers
        out: list = [("--num-layers", layers), ("--num-attention-heads", self.num_attention_heads)]
        if self.num_query_groups is not None:
            out += [("--group-query-attention", True), ("--num-query-groups", self.num_query_groups)]
        if self.num_experts is not None:
            out += [
                ("--num-experts", self.num_experts),
                ("--moe-layer-freq", moe_layer_freq(self.first_k_dense, layers)),
            ]
        return (*out, *self.arch_args)


def moe_layer_freq(first_k_dense: int, num_layers: int) -> str:
    """Megatron's per-layer MoE pattern: the leading dense layers (capped at the depth), then MoE."""
    dense = min(first_k_dense, num_layers)
    parts = [f"[0]*{dense}"] if dense else []
    if num_layers - dense:
        parts.append(f"[1]*{num_layers - dense}")
    return "+".join(parts)


@dataclass(frozen=True)
class ResolvedModel:
    """A spec at a chosen depth, under the name its prepared checkpoint directory gets."""

    spec: ModelSpec
    name: str  # "Inkling-Small-4layer", "Qwen3-4B", "Qwen3-30B-A3B-tiny"
    num_layers: int
    how: str  # why this depth: "keyword", "MODEL_ARGS_NUM_LAYERS=4", "full depth", "tiny"

    @property
    def tiny(self) -> bool:
        return self.how == TINY

    @property
    def is_slice(self) -> bool:
        return not self.tiny and self.num_layers < self.spec.num_layers

    @property
    def shape(self) -> ModelShape:
        return self.spec.shape(self.num_layers, self.name)

    def model_args(self) -> Args:
        return self.spec.model_args(self.num_layers)


class UnknownModel(ValueError):
    pass


def resolve_model(name: str, spec: ModelSpec, env: Mapping[str, str] = os.environ) -> ResolvedModel:
    """`name` (the spec's name, an `-Nlayer` slice of it, or `tiny`) -> the spec at a depth."""
    if name == TINY:
        return ResolvedModel(spec, f"{spec.name}-{TINY}", TINY_LAYERS, TINY)
    match = _SLICE_RE.match(name)
    if match and match["base"] == spec.name:
        layers = int(match["layers"])
        _check_depth(spec, layers, f"model name {name}")
        return ResolvedModel(spec, name, layers, "keyword")
    if name != spec.name:
        raise UnknownModel(f"model '{name}' is not {spec.name}, {spec.name}-<N>layer or {TINY}")
    depth = env.get(DEPTH_ENV, "").strip()
    if not depth:
        return ResolvedModel(spec, name, spec.num_layers, "full depth")
    if not depth.isdigit():
        raise UnknownModel(f"{DEPTH_ENV}={depth!r} is not a layer count")
    layers = int(depth)
    _check_depth(spec, layers, f"{DEPTH_ENV}={depth}")
    sliced = f"{name}-{layers}layer" if layers < spec.num_layers else name
    return ResolvedModel(spec, sliced, layers, f"{DEPTH_ENV}={depth}")


def _check_depth(spec: ModelSpec, layers: int, origin: str) -> None:
    if not 1 <= layers <= spec.num_layers:
        raise UnknownModel(
            f"{origin}: {spec.name} has {spec.num_layers} layers; a slice needs 1..{spec.num_layers}"
        )


_QWEN3_ARCH: Args = (
    ("--normalization", "RMSNorm"),
    ("--norm-epsilon", 1e-6),
    ("--swiglu", True),
    ("--disable-bias-linear", True),
    ("--qk-layernorm", True),
    ("--position-embedding-type", "rope"),
    ("--rotary-base", 1000000),
    ("--vocab-size", 151936),
    ("--kv-channels", 128),
)

QWEN3_4B = ModelSpec(
    "Qwen3-4B", "qwen3", "Qwen/Qwen3-4B", num_layers=36, num_attention_heads=32, num_query_groups=8,
    arch_args=(*_QWEN3_ARCH, ("--hidden-size", 2560), ("--ffn-hidden-size", 9728)),
)  # fmt: skip

QWEN3_30B_A3B = ModelSpec(
    "Qwen3-30B-A3B", "qwen3_moe", "Qwen/Qwen3-30B-A3B", num_layers=48, num_attention_heads=32,
    num_query_groups=4, num_experts=128,
    arch_args=(
        *_QWEN3_ARCH, ("--hidden-size", 2048), ("--ffn-hidden-size", 6144), ("--untie-embeddings-and-output-weights", True),
        ("--moe-ffn-hidden-size", 768), ("--moe-router-topk", 8), ("--moe-grouped-gemm", True),
        ("--moe-token-dispatcher-type", "alltoall"), ("--moe-router-score-function", "softmax"),
        ("--moe-router-load-balancing-type", "none"), ("--moe-aux-loss-coeff", 0),
    ),
)  # fmt: skip

INKLING_SMALL = ModelSpec(
    "Inkling-Small", "inkling", "thinkingmachines/Inkling-Small", num_layers=42, num_attention_heads=32,
    num_query_groups=8, num_experts=128, first_k_dense=2,
    arch_args=(
        ("--hidden-size", 4096), ("--ffn-hidden-size", 12288), ("--kv-channels", 128), ("--normalization", "RMSNorm"),
        ("--norm-epsilon", 1e-6), ("--swiglu", True), ("--disable-bias-linear", True),
        ("--untie-embeddings-and-output-weights", True), ("--vocab-size", 201024), ("--moe-ffn-hidden-size", 1536),
        ("--moe-router-topk", 8), ("--moe-shared-expert-intermediate-size", 3072), ("--moe-grouped-gemm", True),
        ("--moe-token-dispatcher-type", "alltoall"), ("--window-size", 512),
    ),
)  # fmt: skip

GLM5_2_744B_A40B = ModelSpec(
    "GLM-5.2-744B-A40B", "glm_moe_dsa", "zai-org/GLM-5.2", num_layers=78, num_attention_heads=64,
    num_experts=256, first_k_dense=3, attention="dsa",
    arch_args=(
        ("--hidden-size", 6144), ("--ffn-hidden-size", 12288), ("--normalization", "RMSNorm"), ("--norm-epsilon", 1e-5),
        ("--swiglu", True), ("--disable-bias-linear", True), ("--untie-embeddings-and-output-weights", True),
        ("--vocab-size", 154880), ("--multi-latent-attention", True), ("--q-lora-rank", 2048),
        ("--kv-lora-rank", 512), ("--qk-head-dim", 192), ("--qk-pos-emb-head-dim", 64), ("--v-head-dim", 256),
        ("--use-dsa", True), ("--dsa-indexer-n-heads", 32), ("--dsa-indexer-head-dim", 128),
        ("--dsa-indexer-topk", 2048), ("--moe-ffn-hidden-size", 2048), ("--moe-shared-expert-intermediate-size", 2048),
        ("--moe-router-topk", 8), ("--moe-router-score-function", "sigmoid"), ("--moe-router-enable-expert-bias", True),
        ("--moe-router-topk-scaling-factor", 2.5), ("--moe-grouped-gemm", True), ("--moe-token-dispatcher-type", "alltoall"),
    ),
)  # fmt: skip

DEEPSEEK_V4_FLASH = ModelSpec(
    "DeepSeek-V4-Flash", "deepseek_v4", "deepseek-ai/DeepSeek-V4-Flash", num_layers=43, num_attention_heads=64,
    num_query_groups=1, num_experts=256, attention="dsa",
    arch_args=(
        ("--hidden-size", 4096), ("--kv-channels", 512), ("--normalization", "RMSNorm"), ("--norm-epsilon", 1e-6),
        ("--swiglu", True), ("--disable-bias-linear", True), ("--untie-embeddings-and-output-weights", True),
        ("--vocab-size", 129280), ("--q-lora-rank", 1024), ("--use-dsa", True), ("--dsa-indexer-n-heads", 64),
        ("--dsa-indexer-head-dim", 128), ("--dsa-indexer-topk", 512), ("--window-size", 128),
        ("--moe-ffn-hidden-size", 2048), ("--moe-shared-expert-intermediate-size", 2048), ("--moe-router-topk", 6),
        ("--moe-router-enable-expert-bias", True), ("--moe-router-topk-scaling-factor", 1.5),
        ("--moe-grouped-gemm", True), ("--moe-token-dispatcher-type", "alltoall"),
    ),
)  # fmt: skip
