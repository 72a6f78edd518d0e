"""An MTP layer's logits computed from transformers' own modules and DeepSeek-V3's formula, the
reference the MTP workers (tests/megatron/*_worker.py) hold megatron-core's MTP block to:
h' = eh_proj([enorm(embed(t+1)); hnorm(h)]) -> the decoder layer -> final norm -> lm_head, h the
decoder's normed output."""

from __future__ import annotations

import torch


def mtp_formula(
    hf, layer, rotary, weights: dict[str, torch.Tensor], tokens: torch.Tensor, config: dict,
    topk_of: int | None = None,
):  # fmt: skip
    """(logits [b, s, vocab], h, the following tokens, positions, the shared top-k or None) of MTP
    `layer` (a transformers decoder layer) with `rotary` (its model's rotary embedding) and `weights`
    {"enorm", "hnorm", "eh_proj", "final_norm"} read from the checkpoint; `hf` the policy (its
    decoder, embedding and head). `topk_of`: a DSA layer that shares a top-k (GLM-5.2's "shared"
    indexer kind) is handed the one policy layer `topk_of` returned in the same forward, as
    transformers' GlmMoeDsaModel hands each layer the one below it returned."""

    def norm(name: str):
        module = type(hf.model.norm)(int(config["hidden_size"]), eps=float(config["rms_norm_eps"]))
        module.weight.data.copy_(weights[name])
        return module

    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
    seen: dict[str, torch.Tensor] = {}
    hook = None
    if topk_of is not None:
        hook = hf.model.layers[topk_of].register_forward_hook(lambda _m, _a, out: seen.update(topk=out[1]))
    with torch.no_grad():
        h = hf.model(input_ids=tokens).last_hidden_state
        if hook is not None:
            hook.remove()
        # the token after each position; the last has none, and megatron-core's roll_tensor puts id 0 there
        following = torch.roll(tokens, -1, dims=1)
        following[:, -1] = 0
        nxt = hf.model.embed_tokens(following)
        x = torch.nn.functional.linear(
            torch.cat([norm("enorm")(nxt), norm("hnorm")(h)], dim=-1), weights["eh_proj"]
        )
        extra = {"prev_topk_indices": seen["topk"]} if topk_of is not None else {}
        mask = None  # causal without a mask, as the decoder runs it
        if hasattr(layer.self_attn, "indexer"):  # a DSA layer reads the mask itself, as its model builds it
            from transformers.masking_utils import create_causal_mask

            mask = create_causal_mask(
                config=layer.self_attn.config, inputs_embeds=x, attention_mask=None, cache=None,
                position_ids=positions, allow_is_causal_skip=False,
            )  # fmt: skip
        y = layer(
            x, position_embeddings=rotary(x, positions), attention_mask=mask, position_ids=positions, **extra
        )
        y = y[0] if isinstance(y, tuple) else y
        return hf.lm_head(norm("final_norm")(y)), h, following, positions, seen.get("topk")
