"""Run under `torch.distributed.run --nproc-per-node 2`: a GPT family with DeepSeek-V3-style MTP layers
(glm4_moe_lite, glm_moe_dsa) split over two ranks at each (checkpoint dir, layout) of argv's JSON list,
layouts "tp1" (two data-parallel ranks), "tp2sp_ep2" (TP 2 with sequence parallelism, EP 2) and "pp2",
all in this one launch. For each it computes, as the trainer builds the model (miles.families.model
on the layout's parallel state; each rank's part of the weights cut from the checkpoint through the
family's mapping, tests/megatron/layout_logits_worker.py):

- the logits, against transformers';
- the MTP layer's logits: megatron-core's MTP block as the last stage carries it, fed the decoder's
  final hidden state, against a reference built from transformers' own decoder layer L (the class
  built one layer deeper, miles.ckpt.tiny.with_mtp_layers) and DeepSeek-V3's formula
  h' = eh_proj([enorm(embed(t+1)); hnorm(h)]) -> layer L -> shared_head.norm -> lm_head, its
  weights read from the checkpoint by their own names; and against the first layout's MTP logits;
- the gradient norm of the mean token cross-entropy as the trainer gets it, against transformers'
  (tests/support/grad_norms.py).

One `RESULT` line per (checkpoint, layout). Not a test module; tests/megatron/test_megatron_glm4_moe_lite.py
launches it.
"""

from __future__ import annotations

import json
import sys
import warnings

import torch
import torch.distributed as dist

from tests.megatron.layout_logits_worker import full_state, global_name, local_part
from tests.support.grad_norms import grad_norms
from tests.support.mtp_formula import mtp_formula
from tests.support.results import emit

SEQ, BATCH, SEED = 48, 2, 0
LAYOUTS = {  # miles.parallel.ParallelLayout fields
    "tp1": {},
    "tp2sp_ep2": dict(tp=2, sp=True, ep=2, etp=1),
    "pp2": dict(pp=2),
}
_first_mtp: dict[str, torch.Tensor] = {}  # checkpoint -> the first layout's MTP logits (rank 0)


def mtp_reference(path: str, config: dict, family, tokens: torch.Tensor) -> torch.Tensor:
    """The MTP layer's logits from transformers' modules and the DeepSeek-V3 formula."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.ckpt.shards import CheckpointReader
    from miles.ckpt.tiny import with_mtp_layers

    layers = int(config["num_hidden_layers"])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    deeper = AutoModelForCausalLM.from_pretrained(
        path, config=AutoConfig.for_model(**with_mtp_layers(family, config)), dtype=torch.float32,
        attn_implementation="sdpa",  # causal without a mask, as the decoder runs it
    ).eval()  # fmt: skip
    prefix = f"model.layers.{layers}."
    with CheckpointReader(path) as reader:
        names = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final_norm": "shared_head.norm"}
        weights = {key: reader.read(f"{prefix}{name}.weight") for key, name in names.items()}
        layer_weight = reader.read(prefix + "input_layernorm.weight")
    mtp_layer = deeper.model.layers[layers]
    # the deeper class loaded layer L from the checkpoint's MTP block (not its own initialisation)
    assert torch.equal(mtp_layer.input_layernorm.weight, layer_weight), "transformers did not load layer L"

    return mtp_formula(hf, mtp_layer, deeper.model.rotary_emb, weights, tokens, config)[0]


def own_embedding(tc, config: dict, full: dict):
    """A last pipeline stage's word embedding (megatron-core builds one there for MTP; the carried
    block has none): the checkpoint's, cut as the stage's tensor-parallel rank holds it."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    embedding = LanguageModelEmbedding(
        config=tc,
        vocab_size=int(config["vocab_size"]),
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )
    param = embedding.word_embeddings.weight
    with torch.no_grad():
        param.copy_(
            local_part("embedding.word_embeddings.weight", param, full["embedding.word_embeddings.weight"])
        )
    return embedding.eval()


def mtp_logits(model, tc, config: dict, full: dict, tokens, positions, hidden) -> torch.Tensor:
    """The carried MTP block's first layer's logits [b, s, vocab / tp] from the decoder's final hidden state."""
    embedding = model.embedding if model.pre_process else own_embedding(tc, config, full)
    states = model.mtp(
        input_ids=tokens,
        position_ids=positions,
        hidden_states=hidden,
        attention_mask=None,
        embedding=embedding,
    )
    first = torch.chunk(states, 1 + len(model.mtp.layers), dim=0)[1]
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(first, weight=weight)
    return logits.transpose(0, 1)


def gathered(part: torch.Tensor, vocab: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(part) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, part.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., :vocab]


def run_layout(path: str, name: str) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from miles.families import megatron_family, read_config
    from miles.families.model import build_model
    from miles.families.transformer import transformer_config
    from miles.megatron.training import init_parallel_state
    from miles.parallel import ParallelLayout

    hf_logging.set_verbosity_error()
    layout = ParallelLayout(**LAYOUTS[name])
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
        for key, param in model.state_dict(keep_vars=True).items():
            if key.endswith("_extra_state"):
                continue
            part = local_part(key, param, full[global_name(key, offset, local_experts, ep_rank)])
            if part.shape != param.shape:
                raise SystemExit(
                    f"{key}: the rank's part is {list(part.shape)}, the parameter {list(param.shape)}"
                )
            param.copy_(part)
    tokens = torch.randint(3, min(vocab, 500), (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED))
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    result = None
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            incoming = torch.empty(SEQ // layout.tp if layout.sp else SEQ, BATCH, int(config["hidden_size"]))
            dist.recv(incoming, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(incoming)
        seen = {}
        hook = model.decoder.register_forward_hook(lambda m, a, out: seen.update(hidden=out))
        out = model(tokens, positions, None)
        hook.remove()
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        else:
            got = gathered(out, vocab)
            got_mtp = gathered(mtp_logits(model, tc, config, full, tokens, positions, seen["hidden"]), vocab)
            if ps.get_tensor_model_parallel_rank() == 0:
                want = (
                    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                    .eval()(input_ids=tokens)
                    .logits
                )
                want_mtp = mtp_reference(path, config, family, tokens)
                result = {
                    "gap": float((want - got).abs().max()),
                    "mtp_gap": float((want_mtp - got_mtp).abs().max()),
                    "mtp_logits": got_mtp,
                    # the MTP layer predicts otherwise than the model: a mix-up of the two would show
                    "mtp_vs_main": float((want_mtp - want).abs().max()),
                }
    result = {**(result or {}), **grad_norms(model, tc, path, tokens, positions)}
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, result)
    if dist.get_rank() == 0:
        ranks = []
        for r in found:
            logits = r.pop("mtp_logits", None)
            if logits is not None:
                first = _first_mtp.setdefault(path, logits)
                r["mtp_gap_to_first_layout"] = float((logits - first).abs().max())
            ranks.append(r)
        emit({"checkpoint": path, "layout": name, "ranks": ranks})
    ps.destroy_model_parallel()


def main() -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    from miles.megatron import compat

    compat.install()
    for path, layout in json.loads(sys.argv[1]):
        run_layout(path, layout)
    dist.destroy_process_group()


if __name__ == "__main__":
    from miles.train.distributed import exit_process

    main()
    exit_process(0)
