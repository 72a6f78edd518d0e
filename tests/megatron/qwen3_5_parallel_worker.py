"""Run under `torch.distributed.run --nproc-per-node 2`: Qwen3.5-MoE (qwen3_5_moe) split over two ranks at
each layout of argv (after the checkpoint dir: "dp2" (CP1), "tp2sp_ep2", "pp2", "cp2"), in one launch,
computes transformers' logits and the gradient norm transformers' model gets on the same tokens (what
FSDP computes over the HF model): one `RESULT` line per layout. Each rank holds its part of the
weights, cut from the checkpoint through the family's mapping as megatron-core marks each parameter
(tensor-parallel dimension; the gated delta net's in_proj [q; k; v; z; b; a] and conv1d [q; k; v] cut
section by section, as its forward splits them; the rank's experts; its pipeline stage's layers).
Under context parallelism each rank feeds its megatron load-balanced chunks of the sequence and the
logits are put back in order.

Without pipeline parallelism (where this worker has no embedding to give the last stage), the model is set up as
--enable-mtp-training sets it up (miles.megatron.mtp.train_mtp), so its training forward also returns
the MTP layer's logits. Those are compared with a reference built from transformers' own modules
(`mtp_reference`), and with the built-in engine's drafter (miles.train.speculative.MtpDrafter) fed
the same hidden states. Not a test module; tests/megatron/test_megatron_qwen3_5.py launches it.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests.megatron.layout_logits_worker import full_state, global_name
from tests.support.mtp_formula import mtp_formula
from tests.support.results import emit

SEQ, BATCH, SEED = 80, 2, 0  # past one 64-token chunk of the gated delta rule
LAYOUTS = {  # miles.parallel.ParallelLayout fields
    "dp2": dict(),
    "tp2sp_ep2": dict(tp=2, sp=True, ep=2, etp=1),
    "pp2": dict(pp=2),
    "cp2": dict(cp=2),
}


def local_part(name: str, param: torch.Tensor, full: torch.Tensor, config: dict) -> torch.Tensor:
    """The rank's part of the full tensor of its parameter `name`."""
    from megatron.core import parallel_state as ps

    expert = ".local_experts." in name
    tp = ps.get_expert_tensor_parallel_world_size() if expert else ps.get_tensor_model_parallel_world_size()
    rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    kd = config["linear_key_head_dim"] * config["linear_num_key_heads"]
    vd = config["linear_value_head_dim"] * config["linear_num_value_heads"]
    heads = config["linear_num_value_heads"]
    sections = {"in_proj.weight": [kd, kd, vd, vd, heads, heads], "conv1d.weight": [kd, kd, vd]}
    for leaf, sizes in sections.items():
        if name.endswith("self_attention." + leaf):
            return torch.cat([part.chunk(tp, dim=0)[rank] for part in full.split(sizes, dim=0)])
    if name.endswith("linear_fc1.weight"):  # [gate; up]: each rank holds its rows of both
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    dim = getattr(param, "partition_dim", 0)  # the gated delta net's dt_bias and A_log name no dimension
    if full.shape[dim] != param.shape[dim] * tp:
        raise SystemExit(f"{name}: {list(full.shape)} does not split into {tp} of {list(param.shape)}")
    return full.chunk(tp, dim=dim)[rank]


# the MTP block's own tensors (mtp.{name}.weight) by their part in the formula, read independently
# of the drafter's mapping (miles.train.speculative.mtp_layer_names), which this worker checks
MTP_OWN = {
    "enorm": "pre_fc_norm_embedding",
    "hnorm": "pre_fc_norm_hidden",
    "eh_proj": "fc",
    "final_norm": "norm",
}


def mtp_reference(path: str, hf, tokens: torch.Tensor) -> torch.Tensor:
    """MTP layer 0's logits [b, s, vocab] from transformers' own modules and Qwen3.5's MTP formula
    h' = fc([pre_fc_norm_embedding(embed(t+1)); pre_fc_norm_hidden(h)]) -> layer L -> mtp.norm -> lm_head,
    h the decoder's normed output. Layer L is the class one layer deeper (full attention, as the
    release's MTP layer), loaded by transformers from a copy of the checkpoint in which mtp.layers.0.*
    is renamed model.language_model.layers.L.* (so transformers fuses its experts itself)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from miles.families.qwen3_5_moe import FULL, layer_types

    written = json.loads((Path(path) / "config.json").read_text())
    text = written["text_config"]
    depth = int(text["num_hidden_layers"])
    tensors: dict[str, torch.Tensor] = {}
    for shard in Path(path).glob("*.safetensors"):
        tensors |= load_file(shard)
    weights = {key: tensors.pop(f"mtp.{name}.weight") for key, name in MTP_OWN.items()}
    layer = "mtp.layers.0."
    renamed = {
        (f"model.language_model.layers.{depth}." + n.removeprefix(layer) if n.startswith(layer) else n): t
        for n, t in tensors.items()
    }
    deeper_text = {**text, "num_hidden_layers": depth + 1, "layer_types": [*layer_types(text), FULL]}
    deeper_text["mtp_num_hidden_layers"] = 0
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps({**written, "text_config": deeper_text}))
        save_file(renamed, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        deep = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
    mtp_layer = deep.model.layers[depth]
    # transformers loaded layer L from the checkpoint's MTP layer (not its own initialisation)
    if not torch.equal(mtp_layer.input_layernorm.weight, tensors[layer + "input_layernorm.weight"]):
        raise SystemExit("transformers did not load mtp.layers.0 as decoder layer L")

    return mtp_formula(hf, mtp_layer, deep.model.rotary_emb, weights, tokens, text)[:4]


def drafter_logits(path: str, hf, hidden, following, positions) -> torch.Tensor:
    """The built-in engine's drafter (its MTP layer loaded from the checkpoint by its own names) over
    the whole sequence at once, fed the decoder's normed output."""
    from miles.train.speculative import MtpDrafter

    drafter = MtpDrafter(hf, path)
    with torch.no_grad():
        logits, _ = drafter.step(hidden, following, positions, None, drafter.new_cache())
    return logits


def run_layout(path: str, layout_name: str) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from miles.families import megatron_family, read_config
    from miles.families.model import build_model
    from miles.families.transformer import transformer_config
    from miles.megatron import training
    from miles.megatron.attention import context_parallel_order, context_parallel_positions
    from miles.megatron.loss import gather_context_parallel
    from miles.parallel import ParallelLayout

    layout = ParallelLayout(**LAYOUTS[layout_name])
    training.init_parallel_state(layout, seed=1234)
    config = read_config(path)
    family = megatron_family(config)
    tc = transformer_config(config, layout, dtype=torch.float32, initialize=True)
    vocab = int(config["vocab_size"])
    model = build_model(config, vocab, transformer=tc)
    full = full_state(path, config, family)
    offset = get_transformer_layer_offset(tc)
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    local_experts = (tc.num_moe_experts or ep) // ep
    with torch.no_grad():
        for name, param in model.state_dict(keep_vars=True).items():
            if name.endswith("_extra_state"):
                continue
            source = full[global_name(name, offset, local_experts, ep_rank)]
            part = local_part(name, param, source, config)
            if part.shape != param.shape:
                raise SystemExit(
                    f"{name}: the rank's part is {list(part.shape)}, the parameter {list(param.shape)}"
                )
            param.copy_(part)
    # as --enable-mtp-training sets the model up where the trainer trains the MTP layer
    trains_mtp = model.post_process and getattr(model, "mtp", None) is not None and layout.pp == 1
    if trains_mtp:
        from miles.megatron.mtp import train_mtp

        train_mtp(model)

    tokens = torch.randint(3, min(vocab, 500), (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED))
    targets = torch.roll(tokens, -1, dims=1)
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    mine = context_parallel_positions(SEQ, cp, cp_rank) if cp > 1 else torch.arange(SEQ)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    ids, labels = tokens[rows][:, mine], targets[rows][:, mine]
    positions = mine.unsqueeze(0).expand(ids.shape[0], -1)
    tp_group = ps.get_tensor_model_parallel_group()
    seen: dict = {}

    wrapped = training.wrap_ddp([model], tc)
    optim = SimpleNamespace(
        lr=1e-5, min_lr=0.0, weight_decay=0.0, beta1=0.9, beta2=0.98, eps=1e-8, clip_grad=0.0
    )
    optimizer = training.build_optimizer(wrapped, optim, tc)
    training.connect_schedule(tc, wrapped)

    def forward_step(data, chunk):
        ids_, pos_, labels_ = next(data)
        out = chunk(ids_, pos_, None)

        def tp_gathered(part):
            parts = [torch.empty_like(part) for _ in range(ps.get_tensor_model_parallel_world_size())]
            dist.all_gather(parts, part.detach().contiguous(), group=tp_group)
            return torch.cat(parts, dim=-1)[..., :vocab]

        def loss_func(logits):
            if isinstance(logits, tuple):  # the training forward of a model that trains its MTP layer
                logits, (mtp,) = logits
                seen["mtp"] = tp_gathered(mtp)
            seen["logits"] = tp_gathered(logits)
            # every context-parallel rank takes the mean over the whole sequence, as the trainer does
            # (miles.megatron.loss): the gather's backward hands each rank its own tokens' gradient
            losses = gather_context_parallel(
                vocab_parallel_cross_entropy(logits.float().contiguous(), labels_), cp
            )
            return losses.mean(), {"loss": losses.mean().detach()}

        return out, loss_func

    model.train()
    for chunk in wrapped:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    training.run_schedule(
        forward_step, wrapped, [(ids, positions, labels)], seq_length=SEQ // cp, micro_batch_size=ids.shape[0],
        forward_only=False,
    )  # fmt: skip
    _, norm = training.grads_ready(optimizer)

    hf_logging.set_verbosity_error()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    want_logits = hf(input_ids=tokens).logits
    torch.nn.functional.cross_entropy(want_logits.flatten(0, 1), targets.flatten()).backward()
    want = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters() if p.grad is not None)))
    result = {
        "rank": dist.get_rank(),
        "grad_norm": norm,
        "hf_grad_norm": want,
        "grad_norm_rel": abs(norm - want) / want,
    }

    def whole(part: torch.Tensor) -> torch.Tensor:
        """[b, s/cp, v] of this rank, in its order -> [B, S, v] in global order."""
        if cp > 1:
            parts = [torch.empty_like(part) for _ in range(cp)]
            dist.all_gather(parts, part.contiguous(), group=ps.get_context_parallel_group())
            part = torch.cat(parts, dim=1)[:, context_parallel_order(SEQ, cp)]
        if dp > 1:
            parts = [torch.empty_like(part) for _ in range(dp)]
            dist.all_gather(parts, part.contiguous(), group=ps.get_data_parallel_group())
            part = torch.cat(parts, dim=0)
        return part

    if "logits" in seen:  # the last pipeline stage
        got = whole(seen["logits"])
        result["gap"] = float((want_logits.detach() - got).abs().max())
        if trains_mtp:
            got_mtp = whole(seen["mtp"])
            hf.eval()
            want_mtp, hidden, following, pos = mtp_reference(path, hf, tokens)
            result["mtp_gap"] = float((want_mtp - got_mtp).abs().max())
            result["drafter_gap"] = float(
                (want_mtp - drafter_logits(path, hf, hidden, following, pos)).abs().max()
            )
            # the MTP layer predicts otherwise than the model: a mix-up of the two would show
            result["mtp_vs_main"] = float((want_mtp - want_logits.detach()).abs().max())
        result["logits"] = got.flatten().tolist()[:4096:7]  # a sample, for comparing layouts with each other
    return result


def main() -> None:
    warnings.simplefilter("ignore")
    path, layouts = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    from miles.megatron import compat

    compat.install()
    for name in layouts:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, run_layout(path, name))
        if dist.get_rank() == 0:
            emit({"layout": name, "ranks": found})
    dist.destroy_process_group()


if __name__ == "__main__":
    from miles.train.distributed import exit_process

    main()
    exit_process(0)
