"""A tiny Inkling release checkpoint (model_type inkling_mm_model), as the published one is laid out.

transformers' InklingForConditionalGeneration saves its weights under the release's names
(conversion_mapping.py, "inkling_mm_model": `model.llm.*`, gate and up rows interleaved in
`w13_dn`, `experts.w13_weight` and `shared_w13_weight`, the vision and audio towers beside
the decoder). Its config.json is then rewritten in the release's own keys, which
transformers normalises on load: `dense_intermediate_size` for the dense width with
`intermediate_size` the experts' width, `sconv_kernel_size`, `dense_mlp_idx` and
`local_layer_ids` instead of the per-layer lists, an `mtp_config` block at the top level; and
one MTP tensor is added (transformers ignores model.mtp.*). The norms, global scales,
convolutions, relative-bias bank and expert bias are moved off their initial values and the
head scaled up, as in test_megatron_inkling.py. The vision tower has 4 layers of patch 4 and
temporal patch 2 (transformers' plan_out_scales then needs no scipy). Not a test module.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_release_checkpoint(
    out: Path, layers: int = 2, dense: int = 1, local: tuple[int, ...] = (0,)
) -> Path:
    """`layers` decoder layers, the first `dense` dense, those in `local` sliding-window."""
    from safetensors.torch import load_file, save_file
    from transformers import InklingConfig, InklingForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from miles.ckpt.tiny import build_tokenizer
    from miles.families import family

    hf_logging.set_verbosity_error()
    text = {
        **family("inkling").tiny_dims, "num_hidden_layers": layers, "pad_token_id": 0, "tie_word_embeddings": False,
        "dense_mlp_idx": dense, "local_layer_ids": list(local),
    }  # fmt: skip
    vision = {"hidden_size": 32, "num_hidden_layers": 4, "patch_size": 4, "temporal_patch_size": 2}
    config = InklingConfig(
        text_config=text,
        vision_config={**vision, "num_attention_heads": 2},
        audio_config={"n_mel_bins": 4, "mel_vocab_size": 8},
    )
    assert config.text_config.layer_types == [
        "hybrid_sliding" if i in local else "hybrid" for i in range(layers)
    ]
    assert config.text_config.mlp_layer_types == ["dense" if i < dense else "sparse" for i in range(layers)]
    torch.manual_seed(0)
    model = InklingForConditionalGeneration(config).float()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model." not in name and name != "lm_head.weight":
                continue
            if "norm" in name or "global_scale" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)
            elif "sconv" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
            elif "rel_logits_proj" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            elif name == "lm_head.weight":  # logits of order 1
                param.mul_(30.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.05)
    model.save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    t = raw["text_config"]
    t["dense_intermediate_size"] = t.pop("intermediate_size")  # 384: the dense layer's width
    t["intermediate_size"] = t.pop("moe_intermediate_size")  # 64: each expert's
    t["sconv_kernel_size"] = t.pop("conv_kernel_size")
    del t["layer_types"], t["mlp_layer_types"], t["num_mtp_layers"]
    t["dense_mlp_idx"] = dense
    raw["mtp_config"] = {"num_nextn_predict_layers": 1, "local_layer_ids": []}
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    weights = load_file(out / "model.safetensors")
    weights["model.mtp.layers.0.input_proj.weight"] = torch.randn(128, 256, generator=gen)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    build_tokenizer(int(text["max_position_embeddings"])).save_pretrained(out)
    return out
