"""Run under `torch.distributed.run --nproc-per-node 2`: a family's megatron model split over two
ranks at each layout of argv (after the checkpoint dir: "tp2sp", "pp2", "ep2", ...) computes
transformers' logits. The model is built as the trainer builds it (miles.families.model on the
layout's parallel state, the TransformerConfig of miles.families.transformer); each rank holds its
part of the weights: the full tensors from the checkpoint through the family's weight mapping, cut
as megatron-core marks each parameter (tensor-parallel dimension, [gate; up] halves of a SwiGLU's
fc1, the rank's experts, its pipeline stage's layers). One launch serves every layout. Not a test
module; the family tests launch it and read its RESULT line (max |logit gap| per layout).
"""

from __future__ import annotations

import json
import re
import sys
import warnings

import torch
import torch.distributed as dist

SEQ, BATCH, SEED = 48, 2, 0
LAYOUTS = {  # miles.parallel.ParallelLayout fields
    "tp2sp": dict(tp=2, sp=True),
    "tp2sp_ep2": dict(tp=2, sp=True, ep=2, etp=1),
    "ep2": dict(ep=2),
    "pp2": dict(pp=2),
}


def full_state(path, config, family) -> dict:
    from miles.ckpt.shards import CheckpointReader

    out = {}
    with CheckpointReader(path) as reader:
        present = reader.files.weight_map
        for name, pieces in family.weights(config):
            parts = []
            for p in pieces:
                source = family.source_name(p.hf_name, present)
                rows = reader.read(source)[p.index] if p.index is not None else reader.read(source)
                parts.append((p.at, rows[p.hf_index]))
            dim = pieces[0].dim  # rows, or column blocks (MiMo's input_proj halves)
            out[name] = torch.cat([part for _, part in sorted(parts, key=lambda x: x[0])], dim=dim)
    if config.get("tie_word_embeddings"):  # the last stage's output layer shares the embedding
        out["output_layer.weight"] = out["embedding.word_embeddings.weight"]
    return out


def local_part(name: str, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The rank's part of the full tensor of its parameter `name`."""
    from megatron.core import parallel_state as ps

    expert = ".local_experts." in name
    tp = ps.get_expert_tensor_parallel_world_size() if expert else ps.get_tensor_model_parallel_world_size()
    rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):  # [gate; up]: each rank holds its rows of both
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    if full.shape[dim] != param.shape[dim] * tp:
        raise SystemExit(f"{name}: {list(full.shape)} does not split into {tp} of {list(param.shape)}")
    return full.chunk(tp, dim=dim)[rank]


def global_name(name: str, layer_offset: int, local_experts: int, ep_rank: int) -> str:
    name = re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + layer_offset}.", name)
    return re.sub(
        r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m[1]) + ep_rank * local_experts}.", name
    )


def logit_gap(path: str, layout_name: str) -> dict | None:
    """This layout's max |logit gap| to transformers (on the last stage's first rank; None elsewhere)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from miles.families import megatron_family, read_config
    from miles.families.model import build_model
    from miles.families.transformer import transformer_config
    from miles.megatron.training import init_parallel_state
    from miles.parallel import ParallelLayout

    layout = ParallelLayout(**LAYOUTS[layout_name])
    init_parallel_state(layout, seed=1234)
    config = read_config(path)
    family = megatron_family(config)
    tc = transformer_config(config, layout, dtype=torch.float32, initialize=True)
    vocab = int(config["vocab_size"])
    model = build_model(config, vocab, transformer=tc).eval()
    full = full_state(path, config, family)
    offset = get_transformer_layer_offset(tc)
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    local_experts = (tc.num_moe_experts or ep) // ep
    with torch.no_grad():
        for name, param in model.state_dict(keep_vars=True).items():
            if name.endswith("_extra_state"):
                continue
            part = local_part(name, param, full[global_name(name, offset, local_experts, ep_rank)])
            if part.shape != param.shape:
                raise SystemExit(
                    f"{name}: the rank's part is {list(part.shape)}, the parameter {list(param.shape)}"
                )
            param.copy_(part)
    tokens = torch.randint(3, min(vocab, 500), (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED))
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    rows = BATCH * family.pipeline_rows(config)
    result = None
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            seq = SEQ // layout.tp if layout.sp else SEQ
            incoming = torch.empty(seq, rows, int(config["hidden_size"]))
            dist.recv(incoming, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(incoming)
        out = model(tokens, positions, None)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        else:
            parts = [torch.empty_like(out) for _ in range(layout.tp)]
            dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
            got = torch.cat(parts, dim=-1)[..., :vocab]
            hf_logging.set_verbosity_error()
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            want = hf(input_ids=tokens).logits
            if ps.get_tensor_model_parallel_rank() == 0:
                result = {"layout": layout_name, "gap": float((want - got).abs().max())}
    ps.destroy_model_parallel()
    return result


def main() -> None:
    warnings.simplefilter("ignore")
    path, layouts = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    from miles.megatron import compat

    compat.install()
    gaps = []
    for name in layouts:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, logit_gap(path, name))
        gaps += [r for r in found if r is not None]
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(gaps), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from miles.train.distributed import exit_process

    main()
    exit_process(0)
