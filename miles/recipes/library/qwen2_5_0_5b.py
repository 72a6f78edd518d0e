"""GRPO on Qwen2.5-0.5B-Instruct learning GSM8K, trained with Megatron, rolled out with SGLang.

The small model most of the seed framework's nightly tests train (radixark/miles 31f1ca961
tests/e2e/long/test_qwen2.5_0.5B_gsm8k.py and tests/e2e/short/test_qwen2.5_0.5B_gsm8k_short.py):
the GSM8K training set with the math-answer reward, 32 prompts x 8 samples, global batch 256,
TP 1 on 2 GPUs. The seed has no launcher script for it: the reference its command is compared
with is the long GSM8K test's (its `execute()`, read as the launchers are), and the model flags
are its scripts/models/qwen2.5-0.5B.py (same commit).
"""

from miles.parallel import ParallelLayout
from miles.recipes import defaults as d
from miles.recipes import references
from miles.recipes.fidelity import deviation
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
# the reference's layout as it writes it: --sequence-parallel at tp 1, which Megatron-LM turns off
TP1 = ParallelLayout(sp=True)
# The reference's training run, as its test passes it: no checkpoints of its own, no recomputation.
ARGS = d.args_with(
    checkpoint=(("--load", None), ("--save", None), ("--save-interval", None)),
    rollout=(
        ("--prompt-data", "{data_dir}/gsm8k/train.parquet"), ("--input-key", "messages"), ("--rm-type", "math"),
        ("--num-rollout", 250), ("--rollout-max-response-len", 1024), ("--balance-data", None),
    ),
    rollout_engine=(("--sglang-enable-metrics", True),),
    perf=(
        ("--recompute-granularity", None), ("--recompute-method", None), ("--recompute-num-layers", None),
        ("--attention-backend", "flash"),
    ),
)  # fmt: skip

ROCM = Overlay(
    platform="rocm",
    reason="MI350 runners: the seed's GSM8K run on 2 GPUs of the nightly suite",
    profiles=(
        gpu_profile("rocm", 1, 2, MODEL, TP1, rollout_gpus_per_engine=1, suite="nightly-stage-c-2-gpu-mi350"),
        # the seed's short GSM8K test (tests/e2e/short/test_qwen2.5_0.5B_gsm8k_short.py) trains on 8
        gpu_profile("rocm", 1, 8, MODEL, TP1, rollout_gpus_per_engine=1, suite="nightly-stage-c-8-gpu-mi350"),
    ),
)

RECIPE = Recipe(
    name="qwen2_5_0_5b",
    description="GRPO on Qwen2.5-0.5B-Instruct learning GSM8K with the Megatron backend and SGLang rollouts",
    model=QWEN2_5_0_5B,
    models=(MODEL,),
    defined_in=source_file(__name__),
    args=ARGS,
    env=d.ENV,
    profiles=(
        gpu_profile("cuda", 1, 2, MODEL, TP1, rollout_gpus_per_engine=1, suite="stage-c-2-gpu-h200"),
        # the seed's short GSM8K test on 8 GPUs (radixark/miles 31f1ca961,
        # tests/e2e/short/test_qwen2.5_0.5B_gsm8k_short.py: --actor-num-gpus-per-node 8 --colocate)
        gpu_profile("cuda", 1, 8, MODEL, TP1, rollout_gpus_per_engine=1, suite="stage-c-8-gpu-h200"),
        d.cpu_tiny_profile(ParallelLayout(tp=2, sp=True), "megatron"),
    ),
    overlays=(ROCM,),
    references=references.load("qwen2_5_0_5b"),
    deviations=(
        *d.COMMON_DEVIATIONS,
        deviation(
            "--hf-checkpoint={model_dir}/Qwen2.5-0.5B-Instruct",
            "--ref-load={model_dir}/Qwen2.5-0.5B-Instruct_torch_dist",
            "--prompt-data={data_dir}/gsm8k/train.parquet",
            "--megatron-to-hf-mode",
            reason="the test downloads to /root/models and /root/datasets and trains from the HF folder through "
            "Megatron-Bridge; miles trains from the torch_dist prepare-ckpt writes (raw mode) in its own folders",
        ),
        deviation(
            "--rematerialize-param-from-master-weight",
            reason="an option of the reference's own Megatron fork; megatron-core 0.16.1 has none",
        ),
        deviation(
            "--over-sampling-batch-size",
            "--dynamic-sampling-filter-path",
            reason="the reference over-samples and keeps groups whose rewards differ; miles' rollout has no "
            "dynamic sampling yet, so every group of the batch trains",
        ),
        deviation(
            "--ci-test",
            "--ci-disable-kl-checker",
            "--ci-metric-checker-key",
            "--ci-metric-checker-threshold",
            reason="the test's own checks (an eval/gsm8k threshold after 250 rollouts); a CI test passes them with "
            "--extra-args",
        ),
        deviation(
            "--num-rollout=250",
            "--rollout-batch-size=32",
            "--n-samples-per-prompt=8",
            "--rollout-temperature=1",
            "--global-batch-size=256",
            reason="the 8-GPU profile's reference is the seed's short GSM8K test, a 3-rollout smoke run of 8 x 4 "
            "samples at temperature 0.8; the recipe keeps the long run's training settings and the short test's "
            "twin (tests/e2e/seed/test_qwen2_5_0_5b_gsm8k_short.py) passes the short ones with --extra-args",
        ),
        deviation(
            "--object-store-backend",
            "--mooncake-store-init-kwargs",
            reason="the short test moves rollout data through a Mooncake store; miles has no Mooncake backend and "
            "hands rollout data to the trainer in its own processes",
        ),
    ),
)
