"""GRPO on Qwen3-30B-A3B (MoE) with FP8 rollouts, trained with Megatron, rolled out with SGLang."""

from miles.parallel import ParallelConfig
from miles.recipes import defaults as d
from miles.recipes.models import QWEN3_30B_A3B
from miles.recipes.recipe import Overlay, Recipe, gpu_profile, groups, source_file

SLICE = "Qwen3-30B-A3B-4layer"
FULL = "Qwen3-30B-A3B"
# On 4 GPUs with PP2, etp·ep·pp must divide 4: EP2 with ETP1 (EP4 would need 8 ranks).
FOUR_GPUS = ParallelConfig(tp=2, sp=True, pp=2, ep=2, etp=1)
EIGHT_GPUS = ParallelConfig(tp=4, sp=True, ep=8, etp=1)
# The CPU lane's two gloo ranks: the experts split over both, attention data-parallel.
CPU_EP2 = ParallelConfig(ep=2, etp=1)

ROCM = Overlay(
    platform="rocm",
    reason="MI350 runners: MoE all-to-all through mori instead of DeepEP (CUDA-only), AITER kernels",
    args=groups(rollout_engine=(("--sglang-moe-a2a-backend", "mori"),)),
    env=(("SGLANG_USE_AITER", "1"), ("SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "4096")),
    profiles=(
        gpu_profile(
            "rocm",
            1,
            4,
            SLICE,
            FOUR_GPUS,
            rollout_gpus_per_engine=4,
            suite="stage-c-4-gpu-mi350",
            source="EP 2, not 4: the 4-GPU PP2 case upstream failed with EP 4 (expert grid 8 on 4 ranks)",
        ),
        gpu_profile(
            "rocm", 1, 8, FULL, EIGHT_GPUS, rollout_gpus_per_engine=8, suite="nightly-stage-c-8-gpu-mi350"
        ),
    ),
)

RECIPE = Recipe(
    name="qwen3_30b_a3b",
    description="GRPO on Qwen3-30B-A3B with FP8 rollouts, the Megatron backend and SGLang",
    model=QWEN3_30B_A3B,
    models=(SLICE, FULL),
    defined_in=source_file(__name__),
    fp8_rollout=True,
    args=d.args_with(rollout_engine=d.DEEPEP_ROLLOUT_ENGINE),
    env=d.ENV,
    profiles=(
        gpu_profile("cuda", 1, 4, SLICE, FOUR_GPUS, rollout_gpus_per_engine=4, suite="stage-c-4-gpu-h200"),
        gpu_profile("cuda", 1, 8, FULL, EIGHT_GPUS, rollout_gpus_per_engine=8, suite="stage-c-8-gpu-h200"),
        d.cpu_tiny_profile(CPU_EP2, "megatron"),
    ),
    overlays=(ROCM,),
)
