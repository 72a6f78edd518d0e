"""LoRA adapters on megatron-core's linear layers (`--train-backend megatron --lora-rank R`).

Each targeted linear layer W keeps its weight, frozen, and gains A [r, in] and B [out, r] (B zero
at the start, so the first policy is the base model); its output becomes W x + (alpha / r) B A x,
with x the layer's input after its fused norm where it has one (the TE-shaped linear_qkv and a
dense linear_fc1 normalise their input first). Targets are Megatron's fused layers: linear_qkv
(q_proj, k_proj, v_proj), linear_proj (o_proj), linear_fc1 (gate_proj, up_proj) and linear_fc2
(down_proj), in the decoder's attention and dense MLPs.

Under tensor parallelism an adapter is split as its layer is:

- column-parallel (linear_qkv, linear_fc1: the output split): B is split like the output, A is
  whole on every rank. A x is computed on the rank's own tokens and gathered over the
  sequence-parallel ranks (or, without sequence parallelism, passed on with its gradient summed
  over the tensor-parallel ranks, as megatron's column-parallel input is);
- row-parallel (linear_proj, linear_fc2: the input split): A is split like the input, B is whole.
  Each rank's A x is partial and summed over the tensor-parallel ranks (reduce-scattered over the
  sequence under sequence parallelism) before B.

A whole adapter seeing only its rank's tokens under sequence parallelism is marked as the norms
are (`sequence_parallel`), so megatron-core's finalize_model_grads sums its gradient over the
tensor-parallel ranks. Initial values are drawn whole (peft's init: A Kaiming-uniform, B zero)
from a generator seeded by the run's seed and the layer's name, and cut to the rank's shard, so
they do not depend on the layout.

With a fused q/k/v (and gate/up) layer one A serves every part: its PEFT form (`peft_tensors`)
gives q_proj, k_proj and v_proj that same A and each its rows of B, which merges to the same
weights.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import torch


class LoraConfig(Protocol):
    """The LoRA flags (miles.train.config.LoraConfig): rank, scaling, dropout and targets."""

    lora_rank: int
    lora_dropout: float
    target_modules: str | None

    @property
    def scaling(self) -> float: ...


COLUMN, ROW = "column", "row"
# Megatron's linear layer -> (how tensor parallelism splits it, the HF modules it fuses)
LAYERS: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "linear_qkv": (COLUMN, ("q_proj", "k_proj", "v_proj")),
    "linear_proj": (ROW, ("o_proj",)),
    "linear_fc1": (COLUMN, ("gate_proj", "up_proj")),
    "linear_fc2": (ROW, ("down_proj",)),
}
ALL_LINEAR = "all-linear"
# where a targeted layer sits in a decoder layer (a MoE layer's experts are not adapted)
_PLACE = {
    "linear_qkv": "self_attention",
    "linear_proj": "self_attention",
    "linear_fc1": "mlp",
    "linear_fc2": "mlp",
}
_SHARDED_ADAPTER = {COLUMN: "lora_B.weight", ROW: "lora_A.weight"}  # the adapter split like its layer


class LoraRefused(ValueError):
    """--lora-rank / --target-modules that the Megatron backend cannot act on; the message says why."""


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def targets(settings: LoraConfig) -> tuple[str, ...]:
    """The Megatron layers --target-modules names (HF or Megatron spelling), or LoraRefused."""
    value = settings.target_modules or ALL_LINEAR
    if value == ALL_LINEAR:
        return tuple(LAYERS)
    names = [n.strip() for n in value.split(",") if n.strip()]
    hf = {part: layer for layer, (_, parts) in LAYERS.items() for part in parts}
    unknown = [n for n in names if n not in LAYERS and n not in hf]
    if unknown:
        raise LoraRefused(
            f"--target-modules {value}: {', '.join(unknown)} is no linear layer the Megatron backend adapts; "
            f"name {ALL_LINEAR} or some of {', '.join(LAYERS)} (or their HF parts: "
            f"{', '.join(p for _, parts in LAYERS.values() for p in parts)})"
        )
    chosen = []
    for layer, (_, parts) in LAYERS.items():
        named = [p for p in parts if p in names]
        if layer in names or len(named) == len(parts):
            chosen.append(layer)
        elif named:
            raise LoraRefused(
                f"--target-modules {value}: Megatron fuses {', '.join(parts)} into one {layer} layer, which takes "
                f"one adapter; name all of {', '.join(parts)} (or {layer}), or none"
            )
    return tuple(chosen)


def attach(chunks: Sequence, settings: LoraConfig, tc, seed: int) -> list[str]:
    """Freeze every parameter of the chunks and give each targeted layer its adapters; returns
    the adapted layers' names (chunk-relative). LoraRefused when a target names no layer."""
    wanted = targets(settings)
    for chunk in chunks:
        chunk.requires_grad_(False)
    adapted, found = [], set()
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            for name in wanted:
                module = getattr(getattr(layer, _PLACE[name], None), name, None)
                if module is None or not hasattr(module, "weight"):
                    continue
                global_name = f"decoder.layers.{layer.layer_number - 1}.{_PLACE[name]}.{name}"
                _adapt(module, LAYERS[name][0], settings, tc, seed, global_name)
                adapted.append(global_name)
                found.add(name)
    missing = [n for n in wanted if n not in found]
    if missing and chunks and any(len(c.decoder.layers) for c in chunks):
        raise LoraRefused(
            f"--target-modules: this model has no dense {', '.join(missing)} layer to adapt (its attention or "
            "MLP is another kind: multi-latent attention, mixture of experts); target the layers it has"
        )
    return adapted


def _adapt(module, role: str, settings: LoraConfig, tc, seed: int, name: str) -> None:
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    out_local, in_local = module.weight.shape
    out_full, in_full = (out_local * tp, in_local) if role == COLUMN else (out_local, in_local * tp)
    a, b = _initial(settings.lora_rank, in_full, out_full, seed, name)
    gated = name.endswith("linear_fc1") and bool(tc.gated_linear_unit)
    if role == COLUMN:  # B split like the output rows (a gated fc1 holds [gate_r; up_r], as W does)
        b = _shard_rows(b, tp, rank, gated=gated)
    else:
        a = a.chunk(tp, dim=1)[rank]
    device, dtype = module.weight.device, module.weight.dtype
    module.lora_A = _Holder(a.to(device=device, dtype=dtype))
    module.lora_B = _Holder(b.to(device=device, dtype=dtype))
    sharded, whole = (module.lora_B.weight, module.lora_A.weight)
    if role == ROW:
        sharded, whole = whole, sharded
    sharded.tensor_model_parallel, sharded.partition_dim = tp > 1, 0 if role == COLUMN else 1
    # a whole adapter that sees only this rank's tokens: its gradient is summed over TP
    whole.sequence_parallel = bool(tc.sequence_parallel)
    module.lora_role, module.lora_scaling, module.lora_gated = role, settings.scaling, gated
    module.lora_dropout = (
        torch.nn.Dropout(settings.lora_dropout) if settings.lora_dropout else torch.nn.Identity()
    )
    module.__class__ = _adapted_class(type(module))


def _initial(rank: int, fan_in: int, fan_out: int, seed: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's initial adapters, whole: A Kaiming-uniform (a = sqrt(5)), B zero, from a generator
    seeded by the run's seed and the layer's name (the same on every rank, at every layout)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + sum((i + 1) * ord(c) for i, c in enumerate(name)))
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) on [rank, fan_in]
    a = (torch.rand(rank, fan_in, generator=g, dtype=torch.float32) * 2 - 1) * bound
    return a, torch.zeros(fan_out, rank)


def _shard_rows(full: torch.Tensor, tp: int, rank: int, *, gated: bool) -> torch.Tensor:
    if gated:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    return full.chunk(tp, dim=0)[rank]


class _Holder(torch.nn.Module):
    """One adapter matrix, as peft names it (`lora_A.weight`, `lora_B.weight`)."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(value.contiguous())


class _Adapted:
    """What an adapted linear layer adds to its class: the adapter path and its sharded keys."""

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        return output + self.lora_delta(input_), bias

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        norm = getattr(self, "layer_norm_weight", None)
        if norm is not None:  # the layer normalises its input first (TE's fused norm and its stand-in)
            from miles.megatron.spec import _norm_fn

            weight = norm + 1 if getattr(self.config, "layernorm_zero_centered_gamma", False) else norm
            x = _norm_fn(
                self.config, x, weight, getattr(self, "layer_norm_bias", None), self.config.layernorm_epsilon
            )
        h = torch.nn.functional.linear(self.lora_dropout(x), self.lora_A.weight)
        sp = self.config.sequence_parallel
        if self.lora_role == COLUMN:
            h = (
                mappings.gather_from_sequence_parallel_region(h)
                if sp
                else mappings.copy_to_tensor_model_parallel_region(h)
            )
        else:
            h = (
                mappings.reduce_scatter_to_sequence_parallel_region(h)
                if sp
                else mappings.reduce_from_tensor_model_parallel_region(h)
            )
        return torch.nn.functional.linear(h, self.lora_B.weight) * self.lora_scaling

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The layer's own sharded keys, with the adapter split like the layer sharded on its axis
        and the other one replicated (megatron-core would take both as replicated)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        sharded = _SHARDED_ADAPTER[self.lora_role]
        state = {"lora_A.weight": self.lora_A.weight, "lora_B.weight": self.lora_B.weight}
        axis = {sharded: 0 if self.lora_role == COLUMN else 1}
        groups = {
            "tp_group": getattr(self, "tp_group", None),
            "dp_cp_group": (metadata or {}).get("dp_cp_group"),
        }
        adapters = make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets, **groups)
        if self.lora_gated:  # B's rows are [gate_r; up_r] as the weight's: saved as megatron saves those
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora_B.weight"
            singleton = (metadata or {}).get("singleton_local_shards", False)
            adapters[key] = apply_swiglu_sharded_factory(adapters[key], sharded_offsets, singleton)
        out.update(adapters)
        return out


_CLASSES: dict[type, type] = {}


def _adapted_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Lora{cls.__name__}", (_Adapted, cls), {})
    return _CLASSES[cls]


# --- what leaves the trainer ---------------------------------------------------------------


def merged(local: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A rank's tensors (WeightExporter's `local`) with each adapted weight replaced by a new
    tensor W + scaling B A of this rank's shards (B A of the shards is the shard of B A, for both
    roles) carrying the weight's tensor-parallel marks, and the adapters left out."""
    out = {}
    for name, tensor in local.items():
        if is_adapter(name):
            continue
        module = name.removesuffix(".weight")
        a, b = local.get(f"{module}.lora_A.weight"), local.get(f"{module}.lora_B.weight")
        if a is not None and b is not None:
            with torch.no_grad():
                value = (tensor.float() + (b.float() @ a.float()) * scaling).to(tensor.dtype)
            tensor = _marked_like(value, tensor)
        out[name] = tensor
    return out


def b_in_place_of_w(local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapted layers' B under their weight's name (an exporter then cuts B into the HF parts'
    rows as it cuts W), and every other tensor left out."""
    out = {}
    for name, tensor in local.items():
        if name.endswith(".lora_B.weight"):
            out[name.replace(".lora_B.weight", ".weight")] = _marked_like(tensor.detach(), tensor)
    return out


def whole_a(chunks: Sequence) -> dict[str, torch.Tensor]:
    """Each adapted layer's whole A (row-parallel ones gathered over TP), by its global name, from
    every pipeline stage (all ranks call it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    mine = {}
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            for place in ("self_attention", "mlp"):
                for name, module in getattr(layer, place).named_children() if hasattr(layer, place) else ():
                    if not isinstance(module, _Adapted):
                        continue
                    a = module.lora_A.weight.detach()
                    if module.lora_role == ROW and tp > 1:
                        parts = [torch.empty_like(a) for _ in range(tp)]
                        dist.all_gather(parts, a.contiguous(), group=group)
                        a = torch.cat(parts, dim=1)
                    mine[f"decoder.layers.{layer.layer_number - 1}.{place}.{name}"] = a.cpu()
    pp_group = ps.get_pipeline_model_parallel_group()
    stages: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, mine, group=pp_group)
    return {name: a for stage in stages for name, a in stage.items()}


_PART = {part: layer for layer, (_, parts) in LAYERS.items() for part in parts}
_HF_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def peft_tensors(b_parts: Iterable[tuple[str, torch.Tensor]], a_by_layer: Mapping[str, torch.Tensor]) -> dict:
    """PEFT's adapter tensors, `<hf module>.lora_A.default.weight` / `.lora_B.default.weight`:
    `b_parts` are the HF parts of every B (an exporter's output over `b_in_place_of_w`, named
    `...layers.{i}...<part>.weight`), `a_by_layer` the whole A of each Megatron layer (`whole_a`)."""
    out = {}
    for hf_weight, b in b_parts:
        module = hf_weight.removesuffix(".weight")
        part = module.rsplit(".", 1)[-1]
        layer = int(_HF_LAYER.search(module).group(1))
        a = a_by_layer[f"decoder.layers.{layer}.{_PLACE[_PART[part]]}.{_PART[part]}"]
        out[f"{module}.lora_B.default.weight"] = b.detach().cpu()
        out[f"{module}.lora_A.default.weight"] = a.detach().cpu().clone()  # one copy per part
    return out


def hf_targets(adapted: Iterable[str]) -> list[str]:
    """The HF module names the adapted Megatron layers stand for (PEFT's target_modules)."""
    layers = {name.rsplit(".", 1)[-1] for name in adapted}
    return sorted(part for layer in layers for part in LAYERS[layer][1])


def _marked_like(value: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    """`value` with `like`'s tensor-parallel marks (what the exporter's gather reads), copied by
    megatron-core's own helper."""
    if like is not None:
        from megatron.core.tensor_parallel.layers import copy_tensor_model_parallel_attributes

        copy_tensor_model_parallel_attributes(value, like)
    return value
