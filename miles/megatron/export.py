"""The trainer's weights under their Hugging Face names, for the rollout engine.

The names and shapes are those of the installed transformers class's state dict (what the
FSDP backend hands over too): transformers 5 keeps a layer's experts fused, as
`mlp.experts.gate_up_proj` [experts, 2 x ffn, hidden] and `mlp.experts.down_proj`
[experts, hidden, ffn], which are megatron's per-expert `linear_fc1` ([gate; up]) and
`linear_fc2` stacked; a class with one module per expert gets per-expert tensors.

Layer by layer, in order: the ranks of the pipeline stage that owns the layer gather each
tensor-parallel weight (`linear_fc1` shards are [gate_r; up_r], so gate and up are gathered
apart), gather the experts across the expert-parallel group, and broadcast the full tensors
to the other pipeline stages; then every rank turns megatron's fused tensors back into the
HF ones (`linear_qkv` split per query group, `linear_fc1` into gate and up, local expert
indices into global ones). Only one layer's tensors are held at a time. TE's grouped-GEMM
experts are read under SequentialMLP's names (`expert_name`). A family's weights outside the
decoder layers (carried MTP layers, on the last stage) follow under the checkpoint's names
only: the transformers class has no such parameters. The layout is the family's whole-model one
(its `weights`, miles.families), so a family that is not a GPTModel (DeepSeek-V4) exports the
same way; a family whose transformers class renames its checkpoint's tensors on load gives the
class's names (its `model_name`, passed as `rename`) when the engine loads the class's names. A family's release names (Inkling's
`model.llm.*`, its gate and up rows interleaved again) come from its layout like any other.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
# an expert's weight anywhere: (owner prefix, local index, suffix)
_ANY_EXPERT = re.compile(r"^(.*\.)?mlp\.experts\.local_experts\.(\d+)\.(.*)$")
# the weights megatron's SwiGLU MLPs hold as [gate; up] (dense MLP, shared expert)
_GATED = re.compile(r"(^|\.)mlp\.(shared_experts\.(experts\.\d+\.)?)?linear_fc1\.weight$")
# TE's grouped-GEMM experts (TEGroupedMLP, --moe-grouped-gemm) keep local expert i's weight as
# `weight{i}` of one grouped linear (megatron/core/transformer/moe/experts.py,
# TEGroupedMLP.sharded_state_dict: f"{name}.weight{i}").
_GROUPED = re.compile(r"^(.*\.)?mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")


def expert_name(name: str) -> str:
    """A parameter name in SequentialMLP's spelling, `<owner>mlp.experts.local_experts.{i}.
    linear_fc1.weight`, whichever expert module holds it (other names unchanged); the owner is
    empty for a layer-relative name, `mtp.layers.k.transformer_layer.` for a carried MTP layer."""
    m = _GROUPED.match(name)
    if m is None:
        return name
    return f"{m.group(1) or ''}mlp.experts.local_experts.{m.group(4)}.{m.group(2)}.{m.group(3)}"


def _stage_tensors(chunks: Sequence) -> dict[str, torch.Tensor]:
    """This rank's megatron tensors under whole-model names: global layer numbers, local expert
    indices kept (the expert gather turns them global)."""
    out: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        layers = chunk.decoder.layers
        for name, tensor in chunk.state_dict(keep_vars=True).items():
            if name.endswith("_extra_state"):
                continue
            m = _LAYER.match(name)
            if m:
                layer = layers[int(m.group(1))]
                name = f"decoder.layers.{layer.layer_number - 1}.{m.group(2)}"
            out[expert_name(name)] = tensor
    return out


def _gather_tp(tensor: torch.Tensor, group, gated: bool) -> torch.Tensor:
    """The full tensor of a tensor-parallel weight (partition_dim says how it is split)."""
    size = dist.get_world_size(group)
    if size == 1 or not getattr(tensor, "tensor_model_parallel", False):
        return tensor.detach()
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=group)
    dim = tensor.partition_dim
    if gated:  # each rank holds [gate_r; up_r]
        halves = [s.chunk(2, dim=dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(shards, dim=dim)


def _owner_of_layers(chunks: Sequence, num_layers: int, pp_group) -> list[int]:
    """Pipeline rank that holds each global layer."""
    mine = [layer.layer_number - 1 for chunk in chunks for layer in chunk.decoder.layers]
    everyone: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(everyone, mine, group=pp_group)
    owner = [-1] * num_layers
    for pp_rank, layers in enumerate(everyone):
        for i in layers:
            owner[i] = pp_rank
    return owner


class WeightExporter:
    """Streams the full HF state dict out of a (possibly sharded) megatron model, on every rank."""

    def __init__(
        self,
        chunks: Sequence,
        config: Mapping,
        layout: Sequence,
        *,
        rename: Callable[[str], str] | None = None,
        gated: bool = True,
        fused_experts: bool = False,
        extras: bool = False,
        adjust: Callable[[dict], dict] | None = None,
    ):
        """`layout`: the family's (megatron name, pieces) of the whole model (Family.weights);
        `rename`: checkpoint name -> the transformers class's name, when the engine loads those."""
        from megatron.core import parallel_state as ps

        self.chunks = list(chunks)
        self.config = config
        self.layout = list(layout)
        self.gated = gated
        self.tp = ps.get_tensor_model_parallel_group()
        self.etp = ps.get_expert_tensor_parallel_group()
        self.ep = ps.get_expert_model_parallel_group()
        self.pp = ps.get_pipeline_model_parallel_group()
        self.pp_ranks = dist.get_process_group_ranks(self.pp)
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.first = 0
        self.last = dist.get_world_size(self.pp) - 1
        self.owner = _owner_of_layers(self.chunks, config["num_hidden_layers"], self.pp)
        self.fused_experts = fused_experts
        self.extras = extras  # the family's weights outside the decoder layers (MTP): checkpoint names only
        self.rename = rename
        self.adjust = adjust  # this rank's tensors -> the ones handed over (LoRA: merged weights)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        local = _stage_tensors(self.chunks)
        if self.adjust is not None:
            local = self.adjust(local)
        first, layers, last, extras = _by_stage(self.layout, self.config["num_hidden_layers"])
        yield from self._out(
            _to_hf(first, self._from_stage(self.first, local, [n for n, _ in first if n in local]))
        )
        for i in range(self.config["num_hidden_layers"]):
            prefix = f"decoder.layers.{i}."
            names = [n for n in local if n.startswith(prefix)] if self.owner[i] == self.pp_rank else []
            full = self._from_stage(self.owner[i], local, names)
            if self.fused_experts:
                full = _fuse_experts(full, prefix)
            yield from self._out(_to_hf(layers[i], full))
        yield from self._out(
            _to_hf(last, self._from_stage(self.last, local, [n for n, _ in last if n in local]))
        )
        if self.extras:
            wanted = {name for name, _ in extras}
            names = (
                [n for n in local if n in wanted or _expert_of(n, wanted)]
                if self.pp_rank == self.last
                else []
            )
            yield from _to_hf(extras, self._from_stage(self.last, local, names))

    def _out(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors under the transformers class's names when given `rename`, else under the
        checkpoint's."""
        if self.rename is None:
            yield from tensors
            return
        for name, tensor in tensors:
            yield self.rename(name), tensor

    def _from_stage(self, stage: int, local, names: Sequence[str]) -> dict:
        """Full tensors of `names` from pipeline stage `stage`, on every stage."""
        full: dict[str, torch.Tensor] = {}
        if stage == self.pp_rank:
            experts = {}
            for name in names:
                tensor = local[name]
                m = _ANY_EXPERT.match(name)
                if m:
                    experts.setdefault((m.group(1) or "", m.group(3)), []).append((int(m.group(2)), tensor))
                    continue
                full[name] = _gather_tp(tensor, self.tp, self.gated and bool(_GATED.search(name)))
            for (owner, suffix), parts in experts.items():
                full.update(self._gather_experts(owner, suffix, parts))
        if dist.get_world_size(self.pp) == 1:
            return full
        meta = [[(n, tuple(t.shape), t.dtype) for n, t in full.items()]]
        dist.broadcast_object_list(meta, src=self.pp_ranks[stage], group=self.pp)
        for name, shape, dtype in meta[0]:
            if name not in full:
                full[name] = torch.empty(shape, dtype=dtype, device=local_device(local))
            dist.broadcast(full[name], src=self.pp_ranks[stage], group=self.pp)
        return full

    def _gather_experts(self, owner: str, suffix: str, parts) -> dict[str, torch.Tensor]:
        """Every expert's full `suffix` weight of the layer `owner` (a name prefix), under its global
        expert index."""
        parts.sort()
        gated = self.gated and suffix == "linear_fc1.weight"
        local = torch.stack([_gather_tp(t, self.etp, gated) for _, t in parts])
        ep_size = dist.get_world_size(self.ep)
        stacked = [torch.empty_like(local) for _ in range(ep_size)]
        dist.all_gather(stacked, local.contiguous(), group=self.ep)
        per_rank = len(parts)
        return {
            f"{owner}mlp.experts.local_experts.{r * per_rank + k}.{suffix}": stacked[r][k]
            for r in range(ep_size)
            for k in range(per_rank)
        }


def _by_stage(layout: Sequence, num_layers: int) -> tuple[list, dict[int, list], list, list]:
    """The model's weight layout (its family's `weights`) split by where the weights live:
    the first stage's (embedding), each decoder layer's, the last stage's (final norms, output
    layer) and the family's extras outside the decoder (carried MTP layers, `mtp.*`)."""
    first, last, extras = [], [], []
    layers: dict[int, list] = {i: [] for i in range(num_layers)}
    for name, pieces in layout:
        m = _LAYER.match(name)
        if m:
            layers[int(m.group(1))].append((name, pieces))
        elif name.startswith("embedding."):
            first.append((name, pieces))
        elif name.startswith("mtp."):
            extras.append((name, pieces))
        else:
            last.append((name, pieces))
    return first, layers, last, extras


def local_device(local: Mapping[str, torch.Tensor]) -> torch.device:
    return next(iter(local.values())).device


def _expert_of(name: str, wanted: set[str]) -> bool:
    """Whether `name` is a local expert's weight whose global name may be in `wanted`."""
    m = _ANY_EXPERT.match(name)
    return m is not None and any(
        w.startswith(f"{m.group(1) or ''}mlp.experts.local_experts.") for w in wanted
    )


_FUSED = {"linear_fc1.weight": "gate_up_proj", "linear_fc2.weight": "down_proj"}


def _fuse_experts(full: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A layer's per-expert megatron tensors stacked into transformers' fused expert tensors
    (under a placeholder megatron name `mlp.experts.<hf name>` that _to_hf passes through)."""
    experts: dict[str, dict[int, torch.Tensor]] = {}
    rest = {}
    for name, tensor in full.items():
        m = _EXPERT.match(name[len(prefix) :])
        if m and m.group(2) in _FUSED:
            experts.setdefault(m.group(2), {})[int(m.group(1))] = tensor
        else:
            rest[name] = tensor
    for suffix, by_index in experts.items():
        rest[f"{prefix}mlp.experts.{_FUSED[suffix]}"] = torch.stack([by_index[e] for e in sorted(by_index)])
    return rest


def _to_hf(layout, full: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors `layout` (megatron name, pieces) places, cut out of megatron's full ones."""
    layout = list(layout)
    for name, tensor in full.items():
        fused = name.rsplit(".", 1)[-1]
        if ".mlp.experts." in name and fused in _FUSED.values():
            layer = _LAYER.match(name)
            yield f"model.layers.{layer.group(1)}.mlp.experts.{fused}", tensor
    pieces: dict[str, list] = {}
    for name, parts in layout:
        if name not in full:  # an expert weight already handed over fused
            continue
        for piece in parts:
            pieces.setdefault(piece.hf_name, []).append((name, piece))
    for hf_name, parts in pieces.items():
        first = full[parts[0][0]]
        stacked = sorted({p.index for _, p in parts if p.index is not None})
        if stacked:  # one sub-tensor per index (transformers' fused experts)
            rows = sum(p.rows for _, p in parts if p.index == stacked[0])
            shape = (len(stacked), rows, *first.shape[1:])
        elif parts[0][1].dim:  # column blocks of whole rows (MiMo's input_proj)
            shape = (first.shape[0], sum(p.rows for _, p in parts), *first.shape[2:])
        else:
            shape = (sum(p.rows for _, p in parts), *first.shape[1:])
        out = torch.empty(shape, dtype=first.dtype, device=first.device)
        for name, p in parts:
            rows_of = out[p.index] if p.index is not None else out
            rows_of[p.hf_index] = p.of_megatron(full[name])
        yield hf_name, out
