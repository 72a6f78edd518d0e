"""GRPO on GLM-4.7-Flash (MLA, sigmoid-routed MoE, one MTP layer) with rollout routing replay.

Trained by miles' Megatron backend (miles.families.glm4_moe_lite: GLM-5's MLA and experts without
the DSA indexer, the MTP layer carried) from the torch_dist prepare-ckpt converts; the reference
replays the rollout's expert choices in training (R3, --use-rollout-routing-replay), and so does
every form here. Its CPU profile trains the tiny model at TP 2 with sequence parallelism and EP 2.
"""

from miles.parallel import ParallelLayout
from miles.recipes import defaults as d
from miles.recipes import references
from miles.recipes.fidelity import deviation
from miles.recipes.models import ModelSpec, Published
from miles.recipes.recipe import Overlay, Recipe, gpu_profile, source_file

GLM47_FLASH = ModelSpec(
    "GLM-4.7-Flash", "glm4_moe_lite", "zai-org/GLM-4.7-Flash", num_layers=47, num_attention_heads=20,
    num_experts=64, first_k_dense=1,
    arch_args=(
        ("--hidden-size", 2048), ("--ffn-hidden-size", 10240), ("--normalization", "RMSNorm"), ("--norm-epsilon", 1e-5),
        ("--swiglu", True), ("--disable-bias-linear", True), ("--untie-embeddings-and-output-weights", True),
        ("--vocab-size", 154880), ("--make-vocab-size-divisible-by", 64), ("--position-embedding-type", "rope"),
        ("--no-position-embedding", True), ("--rotary-base", 1000000), ("--no-rope-fusion", True),
        ("--qk-layernorm", True), ("--multi-latent-attention", True), ("--q-lora-rank", 768), ("--kv-lora-rank", 512),
        ("--qk-head-dim", 192), ("--qk-pos-emb-head-dim", 64), ("--v-head-dim", 256), ("--kv-channels", 192),
        ("--moe-ffn-hidden-size", 1536), ("--moe-shared-expert-intermediate-size", 1536), ("--moe-router-topk", 4),
        ("--moe-router-score-function", "sigmoid"), ("--moe-router-pre-softmax", True),
        ("--moe-router-enable-expert-bias", True), ("--moe-router-bias-update-rate", 0),
        ("--moe-router-load-balancing-type", "seq_aux_loss"), ("--moe-router-topk-scaling-factor", 1.8),
        ("--moe-aux-loss-coeff", 0), ("--moe-router-dtype", "fp32"),
    ),
    kernel_args=(("--moe-grouped-gemm", True), ("--moe-permute-fusion", True)),
    published=Published(
        "huggingface.co/zai-org/GLM-4.7-Flash/blob/main/config.json as radixark/miles "
        "scripts/models/glm4.7-flash.py@31f1ca961a94 states it (transformers 5.24's Glm4MoeLiteConfig defaults)",
        (
            ("num_hidden_layers", 47), ("hidden_size", 2048), ("intermediate_size", 10240),
            ("moe_intermediate_size", 1536), ("num_attention_heads", 20), ("num_key_value_heads", 20),
            ("n_routed_experts", 64), ("n_shared_experts", 1), ("num_experts_per_tok", 4),
            ("routed_scaling_factor", 1.8), ("first_k_dense_replace", 1), ("q_lora_rank", 768),
            ("kv_lora_rank", 512), ("qk_nope_head_dim", 192), ("qk_rope_head_dim", 64), ("v_head_dim", 256),
            ("rms_norm_eps", 1e-5), ("vocab_size", 154880), ("tie_word_embeddings", False),
            ("rope_theta", 1000000), ("num_nextn_predict_layers", 1),
        ),
    ),
    choices=(
        (
            "num_nextn_predict_layers",
            "the MTP layer is carried (converted, handed to SGLang for speculative decoding), not trained here",
        ),
    ),
)  # fmt: skip


MODEL = "GLM-4.7-Flash"
EIGHT_GPUS = ParallelLayout(tp=4, sp=True, ep=8, etp=1)  # the reference's H200 node
# The 8-GPU form's dimensions on the CPU lane's two ranks: tensor (with sequence) and expert parallel.
CPU_TP2_EP2 = ParallelLayout(tp=2, sp=True, ep=2, etp=1)

# The seed has no AMD launcher for GLM-4.7-Flash: its MI350 run is a test case of its own
# (tests/e2e/megatron/test_glm47_flash/test_amd_r3_mtp.py@31f1ca961a94, twinned here in
# tests/e2e/megatron/test_glm47_flash/), so the ROCm form has no verified profile to offer.
ROCM = Overlay(
    platform="rocm",
    reason="MI350 runners: no reference AMD recipe exists to verify a profile against; the seed's MI350 R3 + MTP "
    "case is a test twin, which prepares the shared form's checkpoint",
)

RECIPE = Recipe(
    name="glm47_flash",
    description="GRPO on GLM-4.7-Flash with routing replay, the Megatron backend and SGLang",
    model=GLM47_FLASH,
    models=(MODEL,),
    defined_in=source_file(__name__),
    args=d.args_with(
        rollout=(("--balance-data", None),),
        grpo=(("--use-rollout-routing-replay", True),),
        optimizer=(
            ("--optimizer-cpu-offload", True),
            ("--overlap-cpu-optimizer-d2h-h2d", True),
            ("--use-precision-aware-optimizer", True),
        ),
        perf=(("--max-tokens-per-gpu", 32768), ("--attention-backend", "flash")),
    ),
    env=d.ENV,
    profiles=(
        gpu_profile("cuda", 1, 8, MODEL, EIGHT_GPUS, rollout_gpus_per_engine=1, suite="stage-c-8-gpu-h200"),
        d.cpu_tiny_profile(CPU_TP2_EP2, "megatron"),
    ),
    overlays=(ROCM,),
    references=references.load("glm47_flash"),
    deviations=(
        *d.COMMON_DEVIATIONS,
        deviation(
            "--add-qkv-bias",
            reason="megatron-core's multi-latent attention has no fused qkv linear and reads no --add-qkv-bias; "
            "GLM-4.7-Flash's projections have no biases (config.json attention_bias false), which "
            "--disable-bias-linear states",
        ),
        deviation(
            "--mtp-num-layers=1",
            reason="the reference builds the MTP layer and trains it only with --enable-mtp-training, which it does "
            "not pass; miles carries the layer (converted, saved, handed to SGLang) outside the training forward "
            "(miles.megatron.mtp), and its backend refuses --mtp-num-layers for this family",
        ),
        deviation(
            "--sglang-speculative-*",
            reason="EAGLE speculation with the MTP layer drafts tokens that SGLang accepts by the target model's "
            "probabilities: it changes decode speed, not the samples' distribution; miles' SGLang engines decode "
            "without it",
        ),
    ),
)
