"""GRPO on DeepSeek-V4-Flash (a 4-layer slice in CI): sparse attention, FP8 rollouts."""

from miles.parallel import ParallelConfig
from miles.recipes import defaults as d
from miles.recipes.models import DEEPSEEK_V4_FLASH
from miles.recipes.recipe import Overlay, Recipe, gpu_profile, groups, source_file

MODEL = "DeepSeek-V4-Flash-4layer"
FOUR_GPUS = ParallelConfig(tp=4, sp=True, ep=4, etp=1)
EIGHT_GPUS = ParallelConfig(tp=8, sp=True, ep=8, etp=1)

ROLLOUT_ENGINE = (*d.DEEPEP_ROLLOUT_ENGINE, ("--sglang-attention-backend", "nsa"))

ROCM = Overlay(
    platform="rocm",
    reason="MI350 runners: MoE all-to-all through mori instead of DeepEP, NSA decode with tilelang kernels",
    args=groups(
        rollout_engine=(("--sglang-moe-a2a-backend", "mori"), ("--sglang-nsa-decode-backend", "tilelang"))
    ),
    env=(("SGLANG_USE_AITER", "1"),),
    profiles=(
        gpu_profile("rocm", 1, 4, MODEL, FOUR_GPUS, rollout_gpus_per_engine=4, suite="stage-c-4-gpu-mi350"),
    ),
)

RECIPE = Recipe(
    name="deepseek_v4",
    description="GRPO on DeepSeek-V4-Flash with FP8 rollouts, the Megatron backend and SGLang",
    model=DEEPSEEK_V4_FLASH,
    models=(MODEL,),
    defined_in=source_file(__name__),
    fp8_rollout=True,
    args=d.args_with(rollout_engine=ROLLOUT_ENGINE),
    env=d.ENV,
    profiles=(
        gpu_profile("cuda", 1, 4, MODEL, FOUR_GPUS, rollout_gpus_per_engine=4, suite="stage-c-4-gpu-h200"),
        gpu_profile("cuda", 1, 8, MODEL, EIGHT_GPUS, rollout_gpus_per_engine=8, suite="stage-c-8-gpu-h200"),
        d.cpu_tiny_profile(),
    ),
    overlays=(ROCM,),
)
