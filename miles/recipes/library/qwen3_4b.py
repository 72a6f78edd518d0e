"""GRPO on Qwen3-4B (dense), trained with Megatron, rolled out with SGLang."""

from miles.parallel import ParallelLayout
from miles.recipes import defaults as d
from miles.recipes import references
from miles.recipes.args import Args
from miles.recipes.fidelity import deviation
from miles.recipes.models import ModelSpec, Published
from miles.recipes.recipe import Overlay, Recipe, gpu_profile, groups, source_file

# Qwen3's architecture flags, shared with Qwen3-30B-A3B (miles.recipes.library.qwen3_30b_a3b)
QWEN3_ARCH: Args = (
    ("--normalization", "RMSNorm"),
    ("--norm-epsilon", 1e-6),
    ("--swiglu", True),
    ("--disable-bias-linear", True),
    ("--qk-layernorm", True),
    ("--position-embedding-type", "rope"),
    ("--rotary-base", 1000000),
    ("--vocab-size", 151936),
    ("--kv-channels", 128),
)

QWEN3_4B = ModelSpec(
    "Qwen3-4B", "qwen3", "Qwen/Qwen3-4B", num_layers=36, num_attention_heads=32, num_query_groups=8,
    arch_args=(*QWEN3_ARCH, ("--hidden-size", 2560), ("--ffn-hidden-size", 9728)),
    published=Published(
        "huggingface.co/Qwen/Qwen3-4B/blob/main/config.json",
        (
            ("num_hidden_layers", 36), ("hidden_size", 2560), ("intermediate_size", 9728),
            ("num_attention_heads", 32), ("num_key_value_heads", 8), ("head_dim", 128),
            ("rms_norm_eps", 1e-6), ("rope_theta", 1000000), ("vocab_size", 151936),
            ("tie_word_embeddings", True), ("attention_bias", False), ("hidden_act", "silu"),
            ("max_position_embeddings", 40960),
        ),
    ),
)  # fmt: skip


MODEL = "Qwen3-4B"
TP2 = ParallelLayout(tp=2, sp=True, etp=1)
# Context parallel with all-to-all exchanges, as the reference sets whenever cp > 1.
TP2_CP2 = ParallelLayout(tp=2, sp=True, cp=2, etp=1, cp_comm_type="a2a")
TP2_CP4 = ParallelLayout(tp=2, sp=True, cp=4, etp=1, cp_comm_type="a2a")  # the reference's 8-GPU layout

ROCM = Overlay(
    platform="rocm",
    reason="MI350 runners: the AMD reference recipe (deepscaler reward, 2-GPU engines, no chunked-prefill cap)",
    args=groups(
        rollout=(("--rm-type", "deepscaler"),),
        rollout_engine=(("--sglang-chunked-prefill-size", None),),
    ),
    profiles=(
        gpu_profile("rocm", 1, 4, MODEL, TP2, rollout_gpus_per_engine=2, suite="nightly-stage-c-4-gpu-mi350"),
        gpu_profile("rocm", 1, 8, MODEL, TP2, rollout_gpus_per_engine=2, suite="nightly-stage-c-8-gpu-mi350"),
    ),
    deviations=(
        deviation(
            "--load",
            "--save",
            reason="miles keeps each run's checkpoints under its run id ({output_dir}/{run_id}/checkpoints), as the "
            "CUDA reference does; the AMD reference writes every run to {output_dir}/checkpoints",
        ),
    ),
)

RECIPE = Recipe(
    name="qwen3_4b",
    description="GRPO on Qwen3-4B with the Megatron backend and SGLang rollouts",
    model=QWEN3_4B,
    models=(MODEL,),
    defined_in=source_file(__name__),
    args=d.args_with(
        rollout=(("--rm-type", "math"),),
        rollout_engine=(("--sglang-chunked-prefill-size", 4096),),
        perf=(("--attention-backend", "flash"),),
    ),
    env=d.ENV,
    profiles=(
        gpu_profile("cuda", 1, 4, MODEL, TP2_CP2, rollout_gpus_per_engine=1, suite="stage-c-4-gpu-h200"),
        gpu_profile("cuda", 1, 8, MODEL, TP2_CP4, rollout_gpus_per_engine=1, suite="stage-c-8-gpu-h200"),
        d.cpu_tiny_profile(TP2, "megatron"),
    ),
    overlays=(ROCM,),
    references=references.load("qwen3_4b"),
    deviations=(
        *d.COMMON_DEVIATIONS,
        deviation(
            "--position-embedding-type",
            "--use-rotary-position-embeddings",
            reason="one switch: Megatron-LM reads --use-rotary-position-embeddings as --position-embedding-type rope",
        ),
        deviation(
            "layout:4",
            reason="the reference states only 8 GPUs (tp2·cp4); the 4-GPU runner keeps tp2 and halves cp",
            platforms=("cuda",),
        ),
        deviation(
            "--load",
            reason="a rerun resumes from the run's own --save in miles, as in the AMD reference; the CUDA reference "
            "--loads the torch_dist every time (both start from the same weights: miles' --ref-load)",
            platforms=("cuda",),
        ),
    ),
)
