"""Qwen3-MoE (Qwen3-30B-A3B; transformers' Qwen3MoeForCausalLM): Qwen3's layers with routed experts.

The mapping is Qwen3's (miles.families.qwen3), which reads the experts, top-k, whether the
top-k weights are renormalised and which layers are MoE from config.json.
"""

from miles.families.facts import COMMON, GQA, MOE, Key, all_moe, negated
from miles.families.qwen3 import Qwen3
from miles.families.schema import QWEN_SCHEMA, TOPK, AtMost, Int, LayerIds


class Qwen3Moe(Qwen3):
    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    keys = (
        *COMMON, *GQA, *MOE,
        Key("num_experts", "--num-experts"),
        # which layers are MoE; a mixed pattern takes both keys, so neither alone refuses a flag
        Key("decoder_sparse_step", "--moe-layer-freq", all_moe, describes_model=False),
        Key("mlp_only_layers", "--moe-layer-freq", all_moe, describes_model=False),
        # false: softmax over all experts, then top-k (Megatron's pre-softmax); true renormalises
        Key("norm_topk_prob", "--moe-router-pre-softmax", negated, default=False),
    )  # fmt: skip
    schema = (
        *QWEN_SCHEMA,
        Int("num_experts"), Int("num_experts_per_tok"), Int("moe_intermediate_size"),
        # transformers' Qwen3MoeDecoderLayer: layer i is MoE when (i + 1) % decoder_sparse_step == 0
        Int("decoder_sparse_step", required=False), LayerIds("mlp_only_layers"),
        AtMost("num_experts_per_tok", "num_experts", TOPK),
    )  # fmt: skip
    schema_aliases = {"num_local_experts": "num_experts"}  # transformers 5 writes num_local_experts
    router_classes = ("Qwen3MoeTopKRouter",)
    tiny_model_type = "qwen3_moe"
    # Qwen3-30B-A3B renormalizes its top-k weights; heads x head_dim != hidden; rope theta 1e6.
    tiny_dims = {
        "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 8, "max_position_embeddings": 4096,
        "intermediate_size": 384, "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
        "num_key_value_heads": 2, "head_dim": 32, "norm_topk_prob": True, "rope_theta": 1_000_000,
    }  # fmt: skip


FAMILY = Qwen3Moe()
