"""GRPO on GLM-5.2-744B-A40B (a 5-layer slice in CI): MLA with DSA sparse attention, FP8 rollouts."""

from miles.parallel import ParallelConfig
from miles.recipes import defaults as d
from miles.recipes.models import GLM5_2_744B_A40B
from miles.recipes.recipe import Overlay, Recipe, gpu_profile, groups, source_file

MODEL = "GLM-5.2-744B-A40B-5layer"
# DSA attention cannot use context parallel; 5 layers keep PP at 1.
FOUR_GPUS = ParallelConfig(tp=4, sp=True, ep=4, etp=1)
EIGHT_GPUS = ParallelConfig(tp=8, sp=True, ep=8, etp=1)

ROLLOUT_ENGINE = (
    # 0.70 leaves room for the weight checker's snapshot; higher turns the trimmed
    # model's spare memory into KV cache.
    ("--sglang-mem-fraction-static", 0.7),
    *d.DEEPEP_ROLLOUT_ENGINE,
    ("--sglang-router-policy", "consistent_hashing"),
    ("--sglang-attention-backend", "nsa"),
)

ROCM = Overlay(
    platform="rocm",
    reason=(
        "MI350 runners: FP8 MoE all-to-all through mori instead of DeepEP, NSA decode with "
        "tilelang kernels and an FP8 KV cache, MLA forced for the NSA indexer"
    ),
    args=groups(
        rollout_engine=(
            ("--sglang-moe-a2a-backend", "mori"),
            ("--sglang-kv-cache-dtype", "fp8_e4m3"),
            ("--sglang-nsa-decode-backend", "tilelang"),
        )
    ),
    env=(("SGLANG_NSA_FORCE_MLA", "1"), ("INDEXER_ROPE_NEOX_STYLE", "0")),
    profiles=(
        gpu_profile("rocm", 1, 4, MODEL, FOUR_GPUS, rollout_gpus_per_engine=4, suite="stage-c-4-gpu-mi350"),
    ),
)

RECIPE = Recipe(
    name="glm5_2_744b_a40b",
    description="GRPO on GLM-5.2-744B-A40B with FP8 rollouts, the Megatron backend and SGLang",
    model=GLM5_2_744B_A40B,
    models=(MODEL,),
    defined_in=source_file(__name__),
    fp8_rollout=True,
    args=d.args_with(
        optimizer=(("--optimizer-cpu-offload", True), ("--use-precision-aware-optimizer", True)),
        rollout_engine=ROLLOUT_ENGINE,
    ),
    env=d.ENV,
    profiles=(
        gpu_profile("cuda", 1, 4, MODEL, FOUR_GPUS, rollout_gpus_per_engine=4, suite="stage-c-4-gpu-h200"),
        gpu_profile("cuda", 1, 8, MODEL, EIGHT_GPUS, rollout_gpus_per_engine=8, suite="stage-c-8-gpu-h200"),
        d.cpu_tiny_profile(),
    ),
    overlays=(ROCM,),
)
