"""MTP-only training of MiMo-7B-RL (Qwen2's trunk, one MTP layer) with SGLang rollouts drafted by that layer.

The seed has no launcher for MiMo-7B-RL: the reference its command is compared with is its MTP
gradient test's (radixark/miles 31f1ca961 tests/e2e/megatron/test_mimo_7B_mtp_only_grad.py, its
`execute()`, read as the launchers are), 4 GPUs at TP 2 with sequence parallelism, and the model
flags are its scripts/models/mimo-7B-rl.py (same commit). Trained by miles' Megatron backend from the
torch_dist prepare-ckpt converts (miles.families.mimo: the trunk as Qwen2's, the MTP layer carried
as megatron-core's MTP block), the MTP layer alone (--mtp-only-training), as the twin
tests/e2e/megatron/test_mimo_7B_mtp_only_grad.py runs it.
"""

from miles.parallel import ParallelLayout
from miles.recipes import defaults as d
from miles.recipes import references
from miles.recipes.fidelity import deviation
from miles.recipes.models import ModelSpec, Published
from miles.recipes.recipe import Overlay, Recipe, gpu_profile, source_file

_SEED = "radixark/miles scripts/models/mimo-7B-rl.py@31f1ca961"

MIMO_7B_RL = ModelSpec(
    "MiMo-7B-RL", "mimo", "XiaomiMiMo/MiMo-7B-RL", num_layers=36, num_attention_heads=32, num_query_groups=8,
    arch_args=(
        ("--hidden-size", 4096), ("--ffn-hidden-size", 11008), ("--swiglu", True), ("--normalization", "RMSNorm"),
        ("--norm-epsilon", 1e-5), ("--use-rotary-position-embeddings", True), ("--rotary-base", 640000),
        ("--disable-bias-linear", True), ("--add-qkv-bias", True), ("--vocab-size", 151680),
        ("--untie-embeddings-and-output-weights", True), ("--max-position-embeddings", 32768),
        ("--mtp-num-layers", 1),
    ),
    published=Published(
        # the seed's Megatron flags for the model, read back as the config.json values they carry
        f"{_SEED} (the Megatron model flags of MiMo-7B-RL)",
        (
            ("num_hidden_layers", 36), ("hidden_size", 4096), ("intermediate_size", 11008),
            ("num_attention_heads", 32), ("num_key_value_heads", 8), ("rms_norm_eps", 1e-5),
            ("rope_theta", 640000), ("vocab_size", 151680), ("tie_word_embeddings", False), ("hidden_act", "silu"),
            ("max_position_embeddings", 32768), ("num_nextn_predict_layers", 1),
        ),
    ),
)  # fmt: skip

MODEL = "MiMo-7B-RL"
FOUR_GPUS = ParallelLayout(tp=2, sp=True)  # the reference's TP2 + SP on 4 GPUs

# the seed registers the same test on a 4-GPU MI350 runner of its nightly suite
ROCM = Overlay(
    platform="rocm",
    reason="MI350 runners: the seed's MiMo MTP gradient test on 4 GPUs of the nightly suite",
    profiles=(
        gpu_profile(
            "rocm", 1, 4, MODEL, FOUR_GPUS, rollout_gpus_per_engine=1, suite="nightly-stage-c-4-gpu-mi350"
        ),
    ),
)

RECIPE = Recipe(
    name="mimo_7b_rl",
    description="MTP-only training of MiMo-7B-RL with the Megatron backend and SGLang rollouts drafted by its MTP layer",
    model=MIMO_7B_RL,
    models=(MODEL,),
    defined_in=source_file(__name__),
    args=d.args_with(
        # the reference's MTP gradient check: no checkpoints of its own, one rollout of 4 x 2 samples cut at
        # 128 tokens (every response truncated, so the policy's loss is nothing and the MTP layer's is all)
        checkpoint=(("--load", None), ("--save", None), ("--save-interval", None)),
        rollout=(
            ("--num-rollout", 1),
            ("--rollout-batch-size", 4),
            ("--n-samples-per-prompt", 2),
            ("--rollout-max-response-len", 128),
            ("--rollout-temperature", 0.8),
            ("--global-batch-size", 8),
            ("--balance-data", None),
        ),
        grpo=(
            ("--use-kl-loss", None),
            ("--kl-coef", 0),
            ("--enable-mtp-training", True),
            ("--mtp-loss-scaling-factor", 0.2),
            ("--mtp-only-training", True),
        ),
        rollout_engine=(
            ("--sglang-enable-metrics", True),
            ("--sglang-speculative-algorithm", "EAGLE"),
            ("--sglang-speculative-num-steps", 2),
            ("--sglang-speculative-eagle-topk", 1),
            ("--sglang-speculative-num-draft-tokens", 3),
        ),
        perf=(("--max-tokens-per-gpu", 4096), ("--attention-backend", "flash")),
    ),
    env=d.ENV,
    profiles=(
        gpu_profile("cuda", 1, 4, MODEL, FOUR_GPUS, rollout_gpus_per_engine=1, suite="stage-c-4-gpu-h200"),
        d.cpu_tiny_profile(ParallelLayout(tp=2, sp=True), "megatron"),
    ),
    overlays=(ROCM,),
    references=references.load("mimo_7b_rl"),
    deviations=(
        *d.COMMON_DEVIATIONS,
        deviation(
            "--hf-checkpoint={model_dir}/MiMo-7B-RL",
            "--ref-load={model_dir}/MiMo-7B-RL_torch_dist",
            "--prompt-data={data_dir}/dapo-math-17k/dapo-math-17k.jsonl",
            reason="the test downloads to /root/models and /root/datasets; miles prepares its own folders (prepare-ckpt)",
        ),
        deviation(
            "--mtp-only-training=on",
            reason="the reference checks that the MTP layer alone gets gradient when the policy's loss is nothing; "
            "miles freezes every other weight instead, so weight decay cannot move the policy either",
        ),
        deviation(
            "--ci-test",
            "--ci-disable-kl-checker",
            reason="the test's own checks; its twin (tests/e2e/megatron/test_mimo_7B_mtp_only_grad.py) runs the "
            "recipe's command and checks the weights",
        ),
        deviation(
            "--rematerialize-param-from-master-weight",
            reason="an option of the reference's own Megatron fork; megatron-core 0.16.1 has none",
        ),
    ),
)
