"""Run under `torch.distributed.run --nproc-per-node 2`: a GPT family with DeepSeek-V3-style MTP layers
(glm4_moe_lite, glm_moe_dsa) or MiMo's split over two ranks at each (checkpoint dir, layout) of argv's
JSON list, layouts "tp1" (two data-parallel ranks), "tp2sp_ep2" (TP 2 with sequence parallelism, EP 2),
"tp2sp" (the same without experts) and "pp2", all in this one launch. For each it computes, as the trainer builds the model (miles.families.model
on the layout's parallel state; each rank's part of the weights cut from the checkpoint through the
family's mapping, tests/megatron/layout_logits_worker.py):

- the logits, against transformers';
- the MTP layer's logits: megatron-core's MTP block as the last stage carries it, fed the decoder's
  final hidden state, against a reference built from transformers' own decoder layer L (the class
  built one layer deeper, miles.ckpt.tiny.with_mtp_layers) and DeepSeek-V3's formula
  h' = eh_proj([enorm(embed(t+1)); hnorm(h)]) -> layer L -> shared_head.norm -> lm_head, its
  weights read from the checkpoint by their own names (MiMo's: `mimo_reference`, SGLang's wiring);
  and against the first layout's MTP logits;
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

from miles.families.facts import source_layers
from tests.megatron.layout_logits_worker import full_state, global_name, local_part
from tests.support.grad_norms import grad_norms
from tests.support.mtp_formula import mtp_formula
from tests.support.results import emit

SEQ, BATCH, SEED = 48, 2, 0
LAYOUTS = {  # miles.parallel.ParallelLayout fields
    "tp1": {},
    "tp2sp_ep2": dict(tp=2, sp=True, ep=2, etp=1),
    "tp2sp": dict(tp=2, sp=True),
    "pp2": dict(pp=2),
}
_first_mtp: dict[str, torch.Tensor] = {}  # checkpoint -> the first layout's MTP logits (rank 0)


def mtp_reference(path: str, config: dict, family, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The MTP layer's logits from transformers' modules and the DeepSeek-V3 formula ("formula"). For
    an MTP layer that shares a policy layer's DSA top-k (GLM-5.2's "shared" kind), transformers'
    layer is handed the top-k that policy layer returned in transformers' own forward, and the
    built-in engine's drafter (miles.train.speculative.MtpDrafter, loaded by its own names) computes
    the same over the whole sequence with that top-k ("drafter")."""
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
    kinds = list(getattr(deeper.config, "indexer_types", None) or [])
    topk_of = source_layers(kinds)[layers] if kinds and kinds[layers] == "shared" else None
    want, h, following, positions, topk = mtp_formula(
        hf, mtp_layer, deeper.model.rotary_emb, weights, tokens, config, topk_of=topk_of
    )
    out = {"formula": want}
    if topk_of is not None:
        from miles.train.speculative import MtpDrafter

        drafter = MtpDrafter(hf, path)
        assert drafter.shares == [True] and drafter.trunk_source == topk_of, (drafter.shares, topk_of)
        with torch.no_grad():
            out["drafter"], _ = drafter.step(h, following, positions, None, drafter.new_cache(), topk=topk)
    return out


def mimo_reference(path: str, config: dict, tokens: torch.Tensor, *, swapped: bool = False) -> torch.Tensor:
    """MiMo's MTP layer's logits wired as SGLang's MiMoMultiTokenPredictorLayer.forward wires them
    (python/sglang/srt/models/mimo_mtp.py at sgl-project/sglang 87d624054f8aa6c610438f96e1395371d8061c08),
    from transformers' own Qwen2DecoderLayer and Qwen2RMSNorm holding the checkpoint's
    model.mtp_layers.0.* tensors: the next token's embedding zeroed at position 0, input_proj of
    [hidden_layernorm(h); token_layernorm(e)] (h: the policy's normed last hidden state, what SGLang's
    target hands its drafter), the decoder layer (its residual included), final_layernorm, lm_head.
    `swapped`: input_proj's halves exchanged (a mapping that forgot MiMo's order computes this)."""
    from transformers import AutoConfig
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

    from miles.ckpt.shards import CheckpointReader
    from miles.ckpt.tiny import with_mtp_layers
    from miles.families import family
    from miles.train.model import load_causal_lm

    hf = load_causal_lm(path, dtype=torch.float32).eval()
    hidden, eps, prefix = int(config["hidden_size"]), float(config["rms_norm_eps"]), "model.mtp_layers.0."
    # the layer as the class one layer deeper builds layer L (its per-layer lists re-derived)
    deeper = AutoConfig.for_model(**with_mtp_layers(family("mimo"), hf.config.to_dict()))
    deeper._attn_implementation = (
        hf.config._attn_implementation
    )  # causal without a mask, as the decoder runs it
    layer = Qwen2DecoderLayer(deeper, layer_idx=int(config["num_hidden_layers"])).eval()
    norms = {
        name: Qwen2RMSNorm(hidden, eps=eps)
        for name in ("token_layernorm", "hidden_layernorm", "final_layernorm")
    }
    with CheckpointReader(path) as reader, torch.no_grad():
        for name, param in layer.state_dict(keep_vars=True).items():
            param.copy_(reader.read(prefix + name))
        for name, norm in norms.items():
            norm.weight.copy_(reader.read(f"{prefix}{name}.weight"))
        input_proj = reader.read(prefix + "input_proj.weight")
    if swapped:
        input_proj = torch.cat(input_proj.chunk(2, dim=1)[::-1], dim=1)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
    with torch.no_grad():
        h = hf.model(input_ids=tokens).last_hidden_state
        following = torch.roll(tokens, -1, dims=1)
        following[:, -1] = 0  # megatron-core's roll_tensor puts id 0 past the end
        e = hf.model.embed_tokens(following)
        e[positions == 0] = 0  # "masking inputs at position 0, as not needed by MTP"
        x = torch.nn.functional.linear(
            torch.cat([norms["hidden_layernorm"](h), norms["token_layernorm"](e)], dim=-1), input_proj
        )
        y = layer(
            x,
            position_embeddings=hf.model.rotary_emb(x, positions),
            attention_mask=None,
            position_ids=positions,
        )
        y = y[0] if isinstance(y, tuple) else y
        return hf.lm_head(norms["final_layernorm"](y))


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
    from miles.megatron.mtp import block_embedding

    embedding = model.embedding if model.pre_process else own_embedding(tc, config, full)
    states = model.mtp(
        input_ids=tokens,
        position_ids=positions,
        hidden_states=hidden,
        attention_mask=None,
        # GPTModel's rope, as the trainer's forward hands it the block (MLA ropes its own)
        rotary_pos_emb=model.rotary_pos_emb(tokens.shape[1]) if hasattr(model, "rotary_pos_emb") else None,
        embedding=block_embedding(model.mtp, embedding, positions),  # as the trainer runs the block
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
    from transformers.utils import logging as hf_logging

    from miles.families import megatron_family, read_config
    from miles.families.model import build_model
    from miles.families.transformer import transformer_config
    from miles.megatron.training import init_parallel_state
    from miles.parallel import ParallelLayout
    from miles.train.model import load_causal_lm

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
                want = load_causal_lm(path, dtype=torch.float32).eval()(input_ids=tokens).logits
                mimo = family.mtp_style == "mimo"
                refs = (
                    {"formula": mimo_reference(path, config, tokens)}
                    if mimo
                    else mtp_reference(path, config, family, tokens)
                )
                want_mtp = refs["formula"]
                result = {
                    "gap": float((want - got).abs().max()),
                    "mtp_gap": float((want_mtp - got_mtp).abs().max()),
                    "mtp_logits": got_mtp,
                    # the MTP layer predicts otherwise than the model: a mix-up of the two would show
                    "mtp_vs_main": float((want_mtp - want).abs().max()),
                }
                if "drafter" in refs:
                    result["drafter_gap"] = float((refs["drafter"] - want_mtp).abs().max())
                if mimo:  # how far the layer is from one whose input_proj halves were left unswapped
                    unswapped = mimo_reference(path, config, tokens, swapped=True)
                    result["mtp_gap_unswapped"] = float((unswapped - got_mtp).abs().max())
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
