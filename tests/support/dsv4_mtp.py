"""DeepSeek-V4's MTP layer computed from transformers' own modules, wired as SGLang 0.5.23's
DeepseekV4ModelNextN.forward wires it (python/sglang/srt/models/deepseek_v4_nextn.py, in the
sglang==0.5.23 wheel the lanes pin): the policy's last streams S [b, s, n, d] (its last decoder
layer's output, before the model's hc_head; what SGLang's target hands its drafter as
`hidden_states_before_norm`), each stream through hnorm and h_proj; the next token's embedding
through enorm and e_proj, added to every stream; the decoder layer (built as layer L of the class
one layer deeper, with the MTP layer's kinds: sliding-window attention, top-k routing); its own
hc_head collapse (SGLang's `hc_head`: transformers' DeepseekV4HyperHead computes the same), the
final norm (mtp.0.norm, SGLang's shared_head.norm) and the policy's lm_head.

transformers has no MTP forward for DeepSeek-V4 (it ignores `mtp.*` on load), so these are its
modules holding the checkpoint's mtp.0.* tensors, which the test checks were loaded."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch


class NextN(torch.nn.Module):
    """MTP layer 0 of the checkpoint in `path` around `hf` (the policy, transformers' class)."""

    EXTRAS = ("enorm", "hnorm", "e_proj", "h_proj", "norm", "hc_head_fn", "hc_head_base", "hc_head_scale")

    def __init__(self, path: Path, hf):
        from safetensors import safe_open
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4HyperHead,
            DeepseekV4RMSNorm,
        )

        from miles.ckpt.tiny import with_mtp_layers
        from miles.families import family

        super().__init__()
        self.hf = hf
        config = json.loads((Path(path) / "config.json").read_text())
        layers = int(config["num_hidden_layers"])
        tensors = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                tensors.update({name: f.get_tensor(name) for name in f.keys()})
        mine = {n[len("mtp.0.") :]: t for n, t in tensors.items() if n.startswith("mtp.0.")}
        extras = {n: mine.pop(n if n.startswith("hc_head_") else f"{n}.weight") for n in self.EXTRAS}
        renamed = {n: t for n, t in tensors.items() if not n.startswith("mtp.")}
        renamed.update({f"model.layers.{layers}.{n}": t for n, t in mine.items()})
        deeper = AutoConfig.for_model(**with_mtp_layers(family("deepseek_v4"), config))
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(deeper.to_dict()))
            save_file(renamed, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
            deep = AutoModelForCausalLM.from_pretrained(tmp, config=deeper, dtype=torch.float32).eval()
        self.layer = deep.model.layers[layers]
        # transformers loaded layer L from the checkpoint's mtp.0.* (not its own initialisation)
        assert torch.equal(self.layer.attn_hc.fn, mine["hc_attn_fn"]), "layer L is not mtp.0"
        assert torch.equal(self.layer.self_attn.q_a_proj.weight, mine["attn.wq_a.weight"]), (
            "layer L is not mtp.0"
        )
        self.rotary, self.deeper = deep.model.rotary_emb, deep.config  # its attention implementation set
        d, eps = int(config["hidden_size"]), float(config["rms_norm_eps"])
        self.enorm, self.hnorm, self.norm = (DeepseekV4RMSNorm(d, eps=eps) for _ in range(3))
        self.e_proj, self.h_proj = (torch.nn.Linear(d, d, bias=False) for _ in range(2))
        self.hc_head = DeepseekV4HyperHead(deeper)
        with torch.no_grad():
            for name in ("enorm", "hnorm", "norm", "e_proj", "h_proj"):
                getattr(self, name).weight.copy_(extras[name])
            for part in ("fn", "base", "scale"):
                getattr(self.hc_head, f"hc_{part}").copy_(extras[f"hc_head_{part}"])

    def streams(self, tokens: torch.Tensor) -> torch.Tensor:
        """The policy's last streams [b, s, n, d] over `tokens`."""
        seen = {}
        hook = self.hf.model.layers[-1].register_forward_hook(lambda _m, _a, out: seen.update(out=out))
        try:
            with torch.no_grad():
                self.hf.model(input_ids=tokens)
        finally:
            hook.remove()
        return seen["out"]

    def forward(self, streams: torch.Tensor, following: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [b, s, vocab], the layer's output streams) from streams [b, s, n, d] and the token
        after each position [b, s]."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        positions = torch.arange(following.shape[1]).unsqueeze(0).expand(following.shape[0], -1)
        e = self.hf.model.embed_tokens(following)
        x = self.e_proj(self.enorm(e)).unsqueeze(2) + self.h_proj(self.hnorm(streams))
        mask = create_sliding_window_causal_mask(
            config=self.deeper, inputs_embeds=e, attention_mask=None, cache=None, position_ids=positions
        )
        rope = {
            kind: self.rotary(e, position_ids=positions, layer_type=kind) for kind in ("main", "compress")
        }
        out = self.layer(
            x, position_embeddings=rope, position_ids=positions, attention_mask=mask, input_ids=following
        )
        return self.hf.lm_head(self.norm(self.hc_head(out))), out


def following_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """The token after each position; id 0 past the end (as megatron-core's MTP block rolls them)."""
    return torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
