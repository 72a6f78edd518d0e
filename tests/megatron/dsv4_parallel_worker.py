"""Run under `torch.distributed.run --nproc-per-node 2`: DeepSeek-V4 (miles.families.deepseek_v4.model) split
over two ranks (argv: checkpoint dir, then a JSON list of [layout, save dir or null] with layouts "tp2sp" |
"ep2" | "pp2", each run in turn in this one launch; a save dir gets the model's shards as the trainer
saves them) computes transformers' logits and gradient norm: one `RESULT` line per layout. Each
rank holds its part of the weights: the full tensors from the checkpoint through the family's
mapping, cut as megatron-core marks each parameter (tensor-parallel dimension, [gate; up] halves of
a SwiGLU's fc1, the rank's experts, its pipeline stage's layers). Not a test module;
tests/megatron/test_megatron_dsv4.py launches it."""

from __future__ import annotations

import json
import re
import sys
import warnings

import torch
import torch.distributed as dist

from tests.support.grad_norms import grad_norms
from tests.support.results import emit

SEQ, BATCH, SEED = 320, 2, 0
LAYOUTS = {  # initialize_model_parallel and TransformerConfig arguments
    # the recipes keep experts whole (expert tensor parallel 1) and spread them over the TP ranks (EP = TP)
    "tp2sp": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1),
    "ep2": dict(expert_model_parallel_size=2),
    "pp2": dict(pipeline_model_parallel_size=2),
}


def full_state(path, config) -> dict:
    from miles.ckpt.shards import CheckpointReader
    from miles.families.deepseek_v4 import FAMILY as family

    out = {}
    with CheckpointReader(path) as reader:
        for name, pieces in family.weights(config):
            names = [family.source_name(p.hf_name, reader.files.weight_map) for p in pieces]
            out[name] = torch.cat(
                [reader.read_rows(n, p.start, p.stop) for n, p in zip(names, pieces, strict=True)]
            )
    return out


def local_part(name: str, param: torch.Tensor, full: torch.Tensor, layer_offset: int, local_experts: int):
    """The rank's part of the full tensor of its parameter `name`."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if not getattr(param, "tensor_model_parallel", False) or tp == 1 or ".local_experts." in name:
        return full
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):  # [gate; up]: each rank holds its rows of both
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    if full.shape[dim] != param.shape[dim] * tp:  # the vocabulary, padded to tp
        raise SystemExit(f"{name}: {list(full.shape)} does not split into {tp} of {list(param.shape)}")
    return full.chunk(tp, dim=dim)[rank]


def global_name(name: str, layer_offset: int, local_experts: int, ep_rank: int) -> str:
    name = re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + layer_offset}.", name)
    return re.sub(
        r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m[1]) + ep_rank * local_experts}.", name
    )


def main() -> None:
    warnings.simplefilter("ignore")
    path, layouts = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    from miles.megatron import compat

    compat.install()
    for layout, saved in layouts:
        run_layout(path, layout, saved)
    dist.destroy_process_group()


def run_layout(path: str, layout: str, saved: str | None) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from miles.families.deepseek_v4 import FAMILY as family

    if ps.model_parallel_is_initialized():  # the previous layout's
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(**LAYOUTS[layout])
    model_parallel_cuda_manual_seed(1234)  # the weight initialisation marks the tensor-parallel parameters
    config = json.loads(open(f"{path}/config.json").read())
    parallel = LAYOUTS[layout]
    tp = parallel.get("tensor_model_parallel_size", 1)
    tc = MLATransformerConfig(
        **family.transformer_fields(config), **parallel, sequence_parallel=tp > 1, params_dtype=torch.float32,
        use_cpu_initialization=True, perform_initialization=True, pipeline_dtype=torch.float32,
    )  # fmt: skip
    model = family.build_model(tc, config, int(config["vocab_size"])).eval()
    full = full_state(path, config)
    offset = get_transformer_layer_offset(tc)
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    local_experts = int(config["n_routed_experts"]) // ep
    with torch.no_grad():
        for name, param in model.state_dict(keep_vars=True).items():
            if name.endswith("_extra_state"):
                continue
            source = full[global_name(name, offset, local_experts, ep_rank)]
            part = local_part(name, param, source, offset, local_experts)
            if part.shape != param.shape:
                raise SystemExit(
                    f"{name}: the rank's part is {list(part.shape)}, the parameter {list(param.shape)}"
                )
            param.copy_(part)
    if saved:  # the trainer's save of the model's shards, for a load at another layout
        from miles.megatron.checkpoint import save_training_state

        save_training_state([model], None, saved, steps_done=None)
    tokens = torch.randint(3, 500, (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED))
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    streams = int(config["hc_mult"]) * BATCH
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            incoming = torch.empty(SEQ, streams, int(config["hidden_size"]))
            dist.recv(incoming, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(incoming)
        out = model(tokens, positions)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            result = None
        else:
            parts = [torch.empty_like(out) for _ in range(tp)]
            dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
            got = torch.cat(parts, dim=-1)[..., : int(config["vocab_size"])]
            hf_logging.set_verbosity_error()
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            want = hf(input_ids=tokens).logits
            result = {"layout": layout, "gap": float((want - got).abs().max()), "rank": dist.get_rank()}
    result = {
        **(result or {}),
        **grad_norms(model, tc, path, tokens, positions, rows=family.pipeline_rows(config)),
    }
    if ps.get_pipeline_model_parallel_world_size() == 1:
        result.update(mtp_gap(model, path, tokens, positions, tp, int(config["vocab_size"])))
    results = [None, None]
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        emit({"layout": layout, "ranks": [r for r in results if r is not None]})


def mtp_gap(model, path: str, tokens, positions, tp: int, vocab: int) -> dict:
    """With its MTP layer training (Model.train_mtp), a training forward's MTP logits against the
    layer wired as SGLang's DeepseekV4ModelNextN wires it from transformers' modules
    (tests/support/dsv4_mtp.py); rank 0 compares."""
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from tests.support.dsv4_mtp import NextN, following_tokens

    model.train_mtp()
    model.train()
    with torch.no_grad():
        _, (mtp,) = model(tokens, positions)
    model.eval()
    parts = [torch.empty_like(mtp) for _ in range(tp)]
    dist.all_gather(parts, mtp.contiguous(), group=ps.get_tensor_model_parallel_group())
    if dist.get_rank():
        return {}
    got = torch.cat(parts, dim=-1)[..., :vocab]
    reference = NextN(path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    with torch.no_grad():
        want, _ = reference(reference.streams(tokens), following_tokens(tokens))
    return {"mtp_gap": float((want - got).abs().max())}


if __name__ == "__main__":
    from miles.train.distributed import exit_process

    main()
    exit_process(0)
