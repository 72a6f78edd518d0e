"""DeepSeek-V4 (DeepSeek-V4-Flash): config.json keys, switches, tiny sizes."""

from miles.models.facts import COMMON, MLA, MOE, MTP, ROUTED_EXPERTS, Family, Key, window

# DeepSeek-V4-Flash's compression ratio of each layer, the MTP layer last (0 sliding window only,
# 4 compressed sparse attention, 128 heavily compressed attention): radixark/miles
# scripts/models/deepseek-v4-flash.py COMPRESS_RATIOS at fe30593dd. transformers folds
# `compress_ratios` into `layer_types` and keeps the first num_hidden_layers entries.
FLASH_COMPRESS_RATIOS = (0, 0, *(4, 128) * 20, 4, 0)


def tiny_values(model, gen) -> None:
    """Seeded values where DeepseekV4PreTrainedModel._init_weights sets a constant: attention sinks,
    compressor position biases, hyper-connection biases and scales, norms (at 0, 1, 0, 1) hide which
    half of a split or which side of a norm a value is on; the expert bias at 0 hides that it only
    selects; `tid2eid` at 0 sends every token to expert 0 twice. Every row of `tid2eid` gets
    distinct experts, as a published table has."""
    import torch

    def noise(shape, scale):
        return torch.randn(shape, generator=gen) * scale

    for name, param in sorted(model.named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("sinks", "position_bias", "base", "hc_base"):
            param.copy_(noise(param.shape, 0.5))
        elif leaf in ("scale", "hc_scale") or (leaf == "weight" and "norm" in name):
            param.add_(noise(param.shape, 0.2))
    for name, buffer in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(noise(buffer.shape, 0.05))
        elif name.endswith("tid2eid"):
            experts = int(model.config.n_routed_experts)
            rows = [torch.randperm(experts, generator=gen)[: buffer.shape[1]] for _ in range(buffer.shape[0])]
            buffer.copy_(torch.stack(rows))


FAMILY = Family(
    "deepseek_v4",
    model_types=("deepseek_v4",),
    attention="dsa",
    keys=(
        *COMMON, *MLA, *MOE, *ROUTED_EXPERTS, *MTP,
        Key("scoring_func", "--moe-router-score-function", default="softmax"),
        Key("routed_scaling_factor", "--moe-router-topk-scaling-factor"),
        Key("q_lora_rank", "--q-lora-rank"),
        Key("qk_rope_head_dim", "--qk-pos-emb-head-dim"),
        Key("index_n_heads", "--dsa-indexer-n-heads"),
        Key("index_head_dim", "--dsa-indexer-head-dim"),
        Key("index_topk", "--dsa-indexer-topk"),
        Key("sliding_window", "--window-size", window),
        Key("rope_scaling_factor", "--rotary-scaling-factor"),
    ),
    tiny_model_type="deepseek_v4",
    # Flash's switches at tiny sizes: its layer pattern (4 layers: sliding, sliding, CSA, HCA; the
    # first 3 hash-routed), 4 hyper-connection streams (with 2 every doubly-stochastic mix is
    # symmetric and a transposed one would not show), YaRN on the compressed layers' rope (factor
    # 16 as published, over 256 positions so that 16x reaches max_position_embeddings). 8 indexer
    # heads: with 2, relu(q.k) ties at the top-k boundary are common and the selection is
    # ill-conditioned for a parity check.
    tiny_dims={
        "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 4096,
        "moe_intermediate_size": 64, "num_key_value_heads": 1, "head_dim": 64, "q_lora_rank": 64,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "o_groups": 2, "o_lora_rank": 32, "index_n_heads": 8,
        "index_head_dim": 32, "index_topk": 16, "hc_mult": 4, "sliding_window": 32, "num_nextn_predict_layers": 1,
        "compress_ratios": list(FLASH_COMPRESS_RATIOS),
        "rope_parameters": {
            "rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 256, "beta_fast": 32,
            "beta_slow": 1,
        },
    },
    sdpa=False,
    mtp_style="mtp",
    tiny_layers=4,
    # The MTP layer attends through the sliding window only and routes by top-k (SGLang 0.5.23
    # models/deepseek_v4_nextn.py COMPRESS_RATIO_NEXTN_LAYER = 0; deepseek_v2.py is_hash excludes nextn)
    mtp_layer_kinds={"layer_types": "sliding_attention", "mlp_layer_types": "moe"},
    tiny_values=tiny_values,
)  # fmt: skip
