"""GRPO on Inkling-Small (a 4-layer slice in CI), trained with Megatron, rolled out with SGLang."""

from miles.parallel import ParallelConfig
from miles.recipes import defaults as d
from miles.recipes.models import INKLING_SMALL
from miles.recipes.recipe import Overlay, Recipe, gpu_profile, source_file

MODEL = "Inkling-Small-4layer"
# TP4 with sequence parallel and all experts spread over the 4 GPUs (ETP1).
TP4_EP4 = ParallelConfig(tp=4, sp=True, ep=4, etp=1)

ROCM = Overlay(
    platform="rocm",
    reason="MI350 runners: AITER kernels in SGLang; Inkling's processor needs numba, which the ROCm image lacked",
    env=(("SGLANG_USE_AITER", "1"),),
    profiles=(
        gpu_profile(
            "rocm", 1, 4, MODEL, TP4_EP4, rollout_gpus_per_engine=4,
            suite="stage-c-4-gpu-mi350", source="the layout the upstream AMD Inkling script verified on 4x MI355X",
        ),
    ),
    pins=(("numba", "0.65.1"),),
)  # fmt: skip

RECIPE = Recipe(
    name="inkling",
    description="GRPO on Inkling-Small with the Megatron backend and SGLang rollouts",
    model=INKLING_SMALL,
    models=(MODEL,),
    defined_in=source_file(__name__),
    args=d.args_with(rollout_engine=(("--sglang-ep-size", "{rollout_gpus_per_engine}"),)),
    env=d.ENV,
    profiles=(
        gpu_profile("cuda", 1, 4, MODEL, TP4_EP4, rollout_gpus_per_engine=4, suite="stage-c-4-gpu-h200"),
        d.cpu_tiny_profile(),
    ),
    overlays=(ROCM,),
)
