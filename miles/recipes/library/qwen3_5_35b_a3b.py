"""GRPO on Qwen3.5-35B-A3B (gated delta net + gated attention MoE, one MTP layer), trained with Megatron,
rolled out with SGLang drafting from the MTP layer (EAGLE, spec v2)."""

from miles.parallel import ParallelLayout
from miles.recipes import defaults as d
from miles.recipes import references
from miles.recipes.fidelity import deviation, renamed
from miles.recipes.models import ModelSpec, Published
from miles.recipes.recipe import Overlay, Recipe, gpu_profile, groups, source_file

QWEN3_5_35B_A3B = ModelSpec(
    "Qwen3.5-35B-A3B", "qwen3_5_moe", "Qwen/Qwen3.5-35B-A3B", num_layers=40, num_attention_heads=16,
    num_query_groups=2, num_experts=256,
    arch_args=(
        ("--normalization", "RMSNorm"), ("--norm-epsilon", 1e-6), ("--swiglu", True), ("--disable-bias-linear", True),
        ("--qk-layernorm", True), ("--apply-layernorm-1p", True), ("--position-embedding-type", "rope"),
        ("--rotary-base", 10000000), ("--rotary-percent", 0.25), ("--vocab-size", 248320), ("--kv-channels", 256),
        ("--hidden-size", 2048), ("--ffn-hidden-size", 512), ("--untie-embeddings-and-output-weights", True),
        ("--moe-ffn-hidden-size", 512), ("--moe-shared-expert-intermediate-size", 512), ("--moe-router-topk", 8),
        ("--moe-router-score-function", "softmax"), ("--moe-token-dispatcher-type", "alltoall"),
        ("--moe-router-dtype", "fp32"), ("--moe-aux-loss-coeff", 0), ("--attention-output-gate", True),
        ("--moe-shared-expert-gate", True), ("--mtp-num-layers", 1),
    ),
    kernel_args=(("--moe-grouped-gemm", True), ("--moe-permute-fusion", True)),
    published=Published(
        "huggingface.co/Qwen/Qwen3.5-35B-A3B/blob/main/config.json",
        (
            ("num_hidden_layers", 40), ("hidden_size", 2048), ("num_attention_heads", 16), ("num_key_value_heads", 2),
            ("head_dim", 256), ("rms_norm_eps", 1e-6), ("rope_theta", 10000000), ("partial_rotary_factor", 0.25),
            ("vocab_size", 248320), ("tie_word_embeddings", False), ("attention_bias", False), ("hidden_act", "silu"),
            ("num_experts", 256), ("num_experts_per_tok", 8), ("moe_intermediate_size", 512),
            ("shared_expert_intermediate_size", 512), ("router_aux_loss_coef", 0.001),
            ("linear_conv_kernel_dim", 4), ("linear_key_head_dim", 128), ("linear_value_head_dim", 128),
            ("linear_num_key_heads", 16), ("linear_num_value_heads", 32), ("full_attention_interval", 4),
            ("mtp_num_hidden_layers", 1), ("max_position_embeddings", 262144),
        ),
    ),
    choices=(
        (
            "router_aux_loss_coef",
            "RL fine-tuning keeps the checkpoint's routing: no load-balancing loss, as in the reference",
        ),
    ),
)  # fmt: skip


FULL = "Qwen3.5-35B-A3B"
CUDA_GRAPH_BS = (1, 2, 4, *range(8, 257, 8))  # the reference's decode batch sizes
EIGHT_GPUS = ParallelLayout(tp=2, sp=True, cp=2, ep=8, etp=1)  # the reference's tp2-cp2-ep8 node
# The seed's AMD case (test_amd_mtp1_spec_v2_r3): a 4-GPU MI350 runner, PP2 x TP2 x EP2 (PP·EP·ETP divides 4).
MI350_FOUR = ParallelLayout(tp=2, sp=True, pp=2, ep=2, etp=1)
CPU_EP2 = ParallelLayout(ep=2, etp=1)  # the CPU lane's two gloo ranks: the experts split over both

ROCM = Overlay(
    platform="rocm",
    reason="MI350 runners: the seed's AMD Qwen3.5 case (4 GPUs, PP2 x TP2 x EP2, one 4-GPU engine)",
    args=groups(
        rollout_engine=(
            ("--sglang-mem-fraction-static", 0.6),  # the case's: colocated training memory leaves less
            ("--sglang-ep-size", "{rollout_gpus_per_engine}"),
            ("--sglang-max-running-requests", 512),
            ("--sglang-disable-shared-experts-fusion", True),
        ),
    ),
    profiles=(
        gpu_profile(
            "rocm", 1, 4, FULL, MI350_FOUR, rollout_gpus_per_engine=4, suite="stage-c-4-gpu-mi350",
            source="tests/e2e/megatron/test_qwen3_5_35B_A3B_mtp/test_amd_mtp1_spec_v2_r3.py (radixark/miles 31f1ca961)",
        ),
    ),
    # the seed has no AMD launcher for Qwen3.5: the AMD form's reference is its AMD CI case, a smoke run
    deviations=(
        deviation(
            "--hf-checkpoint={model_dir}/Qwen3.5-35B-A3B", "--ref-load={model_dir}/Qwen3.5-35B-A3B_torch_dist",
            "--prompt-data={data_dir}/dapo-math-17k/dapo-math-17k.jsonl",
            reason="the test downloads to /root/models and /root/datasets; miles prepares its own folders (prepare-ckpt)",
            platforms=("rocm",),
        ),
        deviation(
            "--load={output_dir}/{run_id}/checkpoints", "--save={output_dir}/{run_id}/checkpoints", "--save-interval=20",
            "--num-rollout=3000", "--rollout-batch-size=32", "--rollout-max-response-len=16384",
            "--global-batch-size=256", "--sglang-cuda-graph-bs-decode=*",
            reason="the case is a 2-rollout smoke run of 8 x 8 samples that saves nothing and keeps SGLang's graph "
            "sizes; the recipe keeps the launcher's training settings, and the case's twin "
            "(tests/e2e/megatron/test_qwen3_5_35B_A3B_mtp/test_amd_mtp1_spec_v2_r3.py) passes the case's",
            platforms=("rocm",),
        ),
        deviation(
            "--use-rollout-routing-replay", "--ci-test", "--check-weight-update-selector",
            "--check-weight-update-skip-list",
            reason="the case's own switches (R3, its checks, the vision tower left out of the weight check); its "
            "twin passes them",
            platforms=("rocm",),
        ),
        deviation(
            "--rematerialize-param-from-master-weight",
            reason="an option of the reference's own Megatron fork; megatron-core 0.16.1 has none",
            platforms=("rocm",),
        ),
    ),
)  # fmt: skip

RECIPE = Recipe(
    name="qwen3_5_35b_a3b",
    description="GRPO on Qwen3.5-35B-A3B with the Megatron backend and SGLang rollouts drafted by its MTP layer",
    model=QWEN3_5_35B_A3B,
    models=(FULL,),
    defined_in=source_file(__name__),
    args=d.args_with(
        optimizer=(
            ("--optimizer-cpu-offload", True),
            ("--overlap-cpu-optimizer-d2h-h2d", True),
            ("--use-precision-aware-optimizer", True),
        ),
        rollout=(("--rollout-max-response-len", 16384),),
        # the MTP layer trains beside the policy (its loss scaled by 0.2), and drafts for SGLang
        grpo=(("--enable-mtp-training", True), ("--mtp-loss-scaling-factor", 0.2)),
        rollout_engine=(
            ("--sglang-cuda-graph-bs-decode", CUDA_GRAPH_BS),
            # EAGLE speculative decoding drafted by the MTP layer, with the mamba scheduler's extra
            # buffer, which pairs it with the radix cache on Qwen3.5-MoE (the seed's recipe also sets
            # SGLANG_ENABLE_SPEC_V2=1, which the pinned sglang 0.5.23 does not read: left out)
            ("--sglang-speculative-algorithm", "EAGLE"),
            ("--sglang-speculative-num-steps", 2),
            ("--sglang-speculative-eagle-topk", 1),
            ("--sglang-speculative-num-draft-tokens", 3),
            ("--sglang-mamba-radix-cache-strategy", "extra_buffer"),
        ),
        perf=(("--max-tokens-per-gpu", 8192), ("--attention-backend", "flash")),
    ),
    env=d.ENV,
    profiles=(
        gpu_profile("cuda", 1, 8, FULL, EIGHT_GPUS, rollout_gpus_per_engine=8, suite="stage-c-8-gpu-h200"),
        d.cpu_tiny_profile(CPU_EP2, "megatron"),
    ),
    overlays=(ROCM,),
    references=references.load("qwen3_5_35b_a3b"),
    deviations=(
        *d.COMMON_DEVIATIONS,
        renamed(
            "--sglang-cuda-graph-bs",
            "--sglang-cuda-graph-bs-decode",
            reason="sglang 0.5.23 splits the CUDA-graph batch sizes into decode and prefill lists; the reference's "
            "are the decode ones",
        ),
        deviation(
            "--moe-token-dispatcher-type=alltoall",
            reason="the reference ends on megatron-core's flex dispatcher (DeepEP/HybridEP kernels, which miles' "
            "Megatron backend does not set up); the all-to-all dispatcher sends every token to the same experts",
        ),
        deviation(
            "--spec",
            reason="the reference builds Qwen3.5 with its plugin's layer spec; miles builds it from the qwen3_5_moe "
            "family (miles/families/qwen3_5_moe: megatron-core's GatedDeltaNet and gated attention), held to "
            "transformers' logits by tests/megatron/test_megatron_qwen3_5.py",
        ),
        deviation(
            "env:SGLANG_ENABLE_SPEC_V2=1",
            reason="the pinned sglang 0.5.23 reads no such variable (no module of it names it): setting it would "
            "claim a switch that does nothing",
        ),
        deviation(
            "--moe-token-drop-policy",
            reason="Megatron's default (probs), and it acts only with an expert capacity factor, which neither sets",
        ),
        deviation(
            "--log-probs-chunk-size",
            reason="a memory option of the reference's trainer (log-probs of the logits in chunks); miles.train has "
            "no such option, and the log-probs are the same",
        ),
    ),
)
