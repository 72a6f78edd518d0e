"""The Megatron model-shape and training-option sections: flags only the megatron backend reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from miles.train.config.flags import MEGATRON, Section, _float, _int, _switch, _text, _window, flag


@dataclass(frozen=True)
class ModelConfig(Section):
    """Megatron's model-shape flags, as recipes emit them. The megatron backend builds the model
    from config.json and refuses a flag that describes another model; fsdp/ddp read config.json."""

    name: ClassVar[str] = "model"
    title: ClassVar[str] = "megatron model shape (megatron backend; fsdp/ddp read the HF config)"
    used_by: ClassVar[tuple[str, ...]] = (MEGATRON,)

    num_layers: int | None = _int()
    hidden_size: int | None = _int()
    ffn_hidden_size: int | None = _int()
    num_attention_heads: int | None = _int()
    num_query_groups: int | None = _int()
    kv_channels: int | None = _int()
    vocab_size: int | None = _int()
    max_position_embeddings: int | None = _int()
    original_max_position_embeddings: int | None = _int()
    make_vocab_size_divisible_by: int | None = _int()
    num_experts: int | None = _int()
    moe_ffn_hidden_size: int | None = _int()
    moe_shared_expert_intermediate_size: int | None = _int()
    moe_router_topk: int | None = _int()
    moe_router_num_groups: int | None = _int()
    moe_router_group_topk: int | None = _int()
    q_lora_rank: int | None = _int()
    kv_lora_rank: int | None = _int()
    qk_head_dim: int | None = _int()
    qk_pos_emb_head_dim: int | None = _int()
    v_head_dim: int | None = _int()
    mtp_num_layers: int | None = _int()
    rotary_interleaved_groups: int | None = _int()
    dsa_indexer_n_heads: int | None = _int()
    dsa_indexer_head_dim: int | None = _int()
    dsa_indexer_topk: int | None = _int()
    num_dense_layers: int | None = _int()
    window_attn_skip_freq: int | None = _int()
    linear_conv_kernel_dim: int | None = _int()
    linear_key_head_dim: int | None = _int()
    linear_value_head_dim: int | None = _int()
    linear_num_key_heads: int | None = _int()
    linear_num_value_heads: int | None = _int()
    norm_epsilon: float | None = _float()
    rotary_base: float | None = _float()
    rotary_percent: float | None = _float()
    rotary_scaling_factor: float | None = _float()
    moe_router_topk_scaling_factor: float | None = _float()
    mscale: float | None = _float()
    mscale_all_dim: float | None = _float()
    beta_fast: float | None = _float()
    beta_slow: float | None = _float()
    normalization: str | None = _text()
    position_embedding_type: str | None = _text()
    moe_router_score_function: str | None = _text()
    moe_layer_freq: str | None = _text()
    qk_layernorm_type: str | None = _text()
    kv_lora_dtype: str | None = _text()
    experimental_attention_variant: str | None = _text()
    linear_attention_freq: str | None = _text()
    swiglu: bool = _switch()
    group_query_attention: bool = _switch()
    use_rotary_position_embeddings: bool = _switch()
    disable_bias_linear: bool = _switch()
    add_qkv_bias: bool = _switch()
    qk_layernorm: bool = _switch()
    untie_embeddings_and_output_weights: bool = _switch()
    moe_router_pre_softmax: bool = _switch()
    moe_router_enable_expert_bias: bool = _switch()
    moe_apply_probs_on_input: bool = _switch()
    multi_latent_attention: bool = _switch()
    no_position_embedding: bool = _switch()
    apply_layernorm_1p: bool = _switch()
    attention_output_gate: bool = _switch()
    moe_shared_expert_gate: bool = _switch()
    use_dsa: bool = _switch()
    vocab_extra_ids: bool = _switch()
    window_size: tuple[int, int] | None = flag(
        type=_window, help="sliding window as Megatron-LM's LEFT,RIGHT (-1: unbounded)"
    )


@dataclass(frozen=True)
class MegatronConfig(Section):
    """Megatron-LM's training, performance and memory options: only the megatron backend can act
    on them, each through its row of miles.megatron.options; the ones it does not act on are
    parsed (a recipe written for Megatron-LM passes them) and refused."""

    name: ClassVar[str] = "megatron"
    title: ClassVar[str] = "megatron training, performance and memory"

    seq_length: int | None = _int()
    attention_dropout: float | None = _float(by=MEGATRON)
    hidden_dropout: float | None = _float(by=MEGATRON)
    init_method_std: float | None = _float()
    moe_router_dtype: str | None = _text(by=MEGATRON)
    moe_router_load_balancing_type: str | None = _text(by=MEGATRON)
    moe_aux_loss_coeff: float | None = _float(by=MEGATRON)
    moe_z_loss_coeff: float | None = _float(by=MEGATRON)
    moe_router_bias_update_rate: float | None = _float(by=MEGATRON)
    moe_router_topk_limited_devices: int | None = _int()
    moe_input_jitter_eps: float | None = _float()
    moe_expert_capacity_factor: float | None = _float()
    moe_pad_expert_input_to_capacity: str | None = _text()
    moe_token_dispatcher_type: str | None = _text(by=MEGATRON)
    mtp_loss_scaling_factor: float = flag(
        by=MEGATRON, type=float, default=0.2, help="weight of the MTP layers' loss when they train"
    )
    enable_mtp_training: bool = flag(
        by=MEGATRON,
        action="store_true",
        help="train the checkpoint's MTP layers on each batch's tokens (their gradient reaches them alone)",
        why_not="transformers' classes (fsdp/ddp) have no MTP forward; train MTP layers with --train-backend megatron",
    )
    mtp_only_training: bool = flag(
        by=MEGATRON,
        action="store_true",
        help="train the MTP layers alone: every other weight frozen (the policy stays bit-identical)",
        why_not="transformers' classes (fsdp/ddp) have no MTP forward; train MTP layers with --train-backend megatron",
    )
    moe_grouped_gemm: bool = _switch(by=MEGATRON)
    moe_permute_fusion: bool = _switch(by=MEGATRON)
    moe_shared_expert_overlap: bool = _switch()
    moe_layer_recompute: int | None = _int()
    recompute_granularity: str | None = _text(by=MEGATRON)
    recompute_method: str | None = _text(by=MEGATRON)
    recompute_num_layers: int | None = flag(by=MEGATRON, type=int)
    recompute_modules: tuple[str, ...] | None = flag(by=MEGATRON, nargs="+")
    attention_backend: str | None = _text(by=MEGATRON)
    transformer_impl: str | None = _text(by=MEGATRON)
    spec: str | None = _text()
    tokenizer_type: str | None = _text()
    tokenizer_model: str | None = _text()
    no_rope_fusion: bool = _switch(by=MEGATRON)
    no_bias_swiglu_fusion: bool = _switch(by=MEGATRON)
    no_bias_dropout_fusion: bool = _switch(by=MEGATRON)
    no_masked_softmax_fusion: bool = _switch(by=MEGATRON)
    no_gradient_accumulation_fusion: bool = _switch(by=MEGATRON)
    use_flash_attn: bool = _switch()
    accumulate_allreduce_grads_in_fp32: bool = _switch(by=MEGATRON)
    attention_softmax_in_fp32: bool = _switch(by=MEGATRON)
    use_distributed_optimizer: bool = _switch(by=MEGATRON)
    overlap_grad_reduce: bool = _switch(by=MEGATRON)
    overlap_param_gather: bool = _switch(by=MEGATRON)
    optimizer_cpu_offload: bool = _switch(by=MEGATRON)
    overlap_cpu_optimizer_d2h_h2d: bool = _switch(by=MEGATRON)
    use_precision_aware_optimizer: bool = _switch(by=MEGATRON)
    dist_ckpt_optim_fully_reshardable: bool = flag(
        by=MEGATRON,
        action="store_true",
        help="save the optimizer state in megatron-core's fully_reshardable format (loads at another TP/PP/EP layout)",
    )
    use_mcore_models: bool = _switch()
    no_load_rng: bool = _switch()
    no_save_rng: bool = _switch()
