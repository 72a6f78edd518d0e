"""An MTP layer's logits computed from transformers' own modules and DeepSeek-V3's formula, the
reference the MTP workers (tests/megatron/*_worker.py) hold megatron-core's MTP block to:
h' = eh_proj([enorm(embed(t+1)); hnorm(h)]) -> the decoder layer -> final norm -> lm_head, h the
decoder's normed output."""

from __future__ import annotations

import torch


def mtp_formula(hf, layer, rotary, weights: dict[str, torch.Tensor], tokens: torch.Tensor, config: dict):
    """(logits [b, s, vocab], h, the following tokens, positions) of MTP `layer` (a transformers decoder
    layer) with `rotary` (its model's rotary embedding) and `weights` {"enorm", "hnorm", "eh_proj",
    "final_norm"} read from the checkpoint; `hf` the policy (its decoder, embedding and head)."""

    def norm(name: str):
        module = type(hf.model.norm)(int(config["hidden_size"]), eps=float(config["rms_norm_eps"]))
        module.weight.data.copy_(weights[name])
        return module

    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
    with torch.no_grad():
        h = hf.model(input_ids=tokens).last_hidden_state
        # the token after each position; the last has none, and megatron-core's roll_tensor puts id 0 there
        following = torch.roll(tokens, -1, dims=1)
        following[:, -1] = 0
        nxt = hf.model.embed_tokens(following)
        x = torch.nn.functional.linear(
            torch.cat([norm("enorm")(nxt), norm("hnorm")(h)], dim=-1), weights["eh_proj"]
        )
        y = layer(x, position_embeddings=rotary(x, positions), attention_mask=None, position_ids=positions)
        return hf.lm_head(norm("final_norm")(y)), h, following, positions
