"""GRPO on Qwen3-4B (dense), trained with Megatron, rolled out with SGLang."""

from miles.parallel import ParallelConfig
from miles.recipes import defaults as d
from miles.recipes.models import QWEN3_4B
from miles.recipes.recipe import Overlay, Recipe, gpu_profile, groups, source_file

MODEL = "Qwen3-4B"
TP2 = ParallelConfig(tp=2, sp=True)

ROCM = Overlay(
    platform="rocm",
    reason="MI350 runners: SGLang's AITER attention kernels instead of FlashInfer",
    args=groups(rollout_engine=(("--sglang-attention-backend", "aiter"),)),
    env=(("SGLANG_USE_AITER", "1"),),
    profiles=(
        gpu_profile("rocm", 1, 4, MODEL, TP2, rollout_gpus_per_engine=1, suite="nightly-stage-c-4-gpu-mi350"),
        gpu_profile("rocm", 1, 8, MODEL, TP2, rollout_gpus_per_engine=1, suite="nightly-stage-c-8-gpu-mi350"),
    ),
)

RECIPE = Recipe(
    name="qwen3_4b",
    description="GRPO on Qwen3-4B with the Megatron backend and SGLang rollouts",
    model=QWEN3_4B,
    models=(MODEL,),
    defined_in=source_file(__name__),
    args=d.args_with(
        rollout=(("--rollout-max-response-len", 4096),),
        rollout_engine=(("--sglang-attention-backend", "flashinfer"),),
    ),
    env=d.ENV,
    profiles=(
        gpu_profile("cuda", 1, 4, MODEL, TP2, rollout_gpus_per_engine=1, suite="stage-c-4-gpu-h200"),
        gpu_profile("cuda", 1, 8, MODEL, TP2, rollout_gpus_per_engine=1, suite="stage-c-8-gpu-h200"),
        d.cpu_tiny_profile(TP2, "megatron"),
    ),
    overlays=(ROCM,),
)
