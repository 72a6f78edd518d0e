"""GRPO on Qwen2.5-0.5B-Instruct learning GSM8K, trained with Megatron, rolled out with SGLang.

The small model most of the seed framework's nightly tests train (radixark/miles 31f1ca961
tests/e2e/long/test_qwen2.5_0.5B_gsm8k.py and tests/e2e/short/test_qwen2.5_0.5B_gsm8k_short.py):
the GSM8K training set with the math-answer reward, 32 prompts x 8 samples, global batch 256,
TP 1. The seed has no launcher script for it, so there is no reference recipe to diff against;
the model flags are its scripts/models/qwen2.5-0.5B.py (same commit).
"""

from miles.parallel import ParallelLayout
from miles.recipes import defaults as d
from miles.recipes.models import ModelSpec, Published
from miles.recipes.recipe import Overlay, Recipe, gpu_profile, source_file

_SEED = "radixark/miles scripts/models/qwen2.5-0.5B.py@31f1ca961"

QWEN2_5_0_5B = ModelSpec(
    "Qwen2.5-0.5B-Instruct", "qwen2", "Qwen/Qwen2.5-0.5B-Instruct", num_layers=24, num_attention_heads=14,
    num_query_groups=2,
    arch_args=(
        ("--hidden-size", 896), ("--ffn-hidden-size", 4864), ("--swiglu", True), ("--normalization", "RMSNorm"),
        ("--norm-epsilon", 1e-6), ("--use-rotary-position-embeddings", True), ("--rotary-base", 1000000),
        ("--disable-bias-linear", True), ("--add-qkv-bias", True), ("--vocab-size", 151936),
    ),
    published=Published(
        # the seed's Megatron flags for the model, read back as the config.json values they carry; no
        # --untie-embeddings-and-output-weights there: the embeddings are tied
        f"{_SEED} (the Megatron model flags of Qwen2.5-0.5B)",
        (
            ("num_hidden_layers", 24), ("hidden_size", 896), ("intermediate_size", 4864),
            ("num_attention_heads", 14), ("num_key_value_heads", 2), ("rms_norm_eps", 1e-6),
            ("rope_theta", 1000000), ("vocab_size", 151936), ("tie_word_embeddings", True), ("hidden_act", "silu"),
        ),
    ),
)  # fmt: skip

MODEL = "Qwen2.5-0.5B-Instruct"
TP1 = ParallelLayout()
GSM8K = (
    ("--prompt-data", "{data_dir}/gsm8k/train.parquet"),
    ("--input-key", "messages"),
    ("--label-key", "label"),
    ("--rm-type", "math"),
    ("--rollout-max-response-len", 1024),
    ("--num-rollout", 250),
)

ROCM = Overlay(
    platform="rocm",
    reason="MI350 runners: the seed's GSM8K runs on 2 GPUs (nightly) and 8 GPUs (nightly, short)",
    profiles=(
        gpu_profile("rocm", 1, 2, MODEL, TP1, rollout_gpus_per_engine=1, suite="nightly-stage-c-2-gpu-mi350"),
        gpu_profile("rocm", 1, 8, MODEL, TP1, rollout_gpus_per_engine=1, suite="nightly-stage-c-8-gpu-mi350"),
    ),
)

RECIPE = Recipe(
    name="qwen2_5_0_5b",
    description="GRPO on Qwen2.5-0.5B-Instruct learning GSM8K with the Megatron backend and SGLang rollouts",
    model=QWEN2_5_0_5B,
    models=(MODEL,),
    defined_in=source_file(__name__),
    args=d.args_with(
        rollout=GSM8K,
        perf=(("--attention-backend", "flash"),),
        rollout_engine=(("--sglang-enable-metrics", True),),
    ),
    env=d.ENV,
    profiles=(
        gpu_profile("cuda", 1, 2, MODEL, TP1, rollout_gpus_per_engine=1, suite="stage-c-2-gpu-h200"),
        gpu_profile("cuda", 1, 8, MODEL, TP1, rollout_gpus_per_engine=1, suite="stage-c-8-gpu-h100"),
        d.cpu_tiny_profile(ParallelLayout(tp=2, sp=True), "megatron"),
    ),
    overlays=(ROCM,),
)
