"""Argument groups every recipe starts from, the CPU `tiny` profile they all share, and the
differences from the reference recipes that every recipe shares, with their reasons.

The GRPO numbers are the reference recipes': lr 1e-6, weight decay 0.1, Adam betas 0.9/0.98,
eps-clip 0.2/0.28, 32 prompts x 8 samples per rollout, global batch 256, k3 (low_var_kl) KL
with coefficient 0 (logged, not trained on).
"""

from __future__ import annotations

from miles.parallel import ParallelLayout
from miles.recipes.args import Args, merge
from miles.recipes.fidelity import deviation, renamed
from miles.recipes.models import TINY
from miles.recipes.recipe import ParallelProfile, groups

CHECKPOINT: Args = (
    ("--hf-checkpoint", "{hf_checkpoint}"),
    ("--ref-load", "{ref_load}"),
    ("--load", "{save_dir}"),
    ("--save", "{save_dir}"),
    ("--save-interval", 20),
)

ROLLOUT: Args = (
    ("--prompt-data", "{data_dir}/dapo-math-17k/dapo-math-17k.jsonl"),
    ("--input-key", "prompt"),
    ("--label-key", "label"),
    ("--apply-chat-template", True),
    ("--rollout-shuffle", True),
    ("--rm-type", "deepscaler"),
    ("--num-rollout", 3000),
    ("--rollout-batch-size", 32),
    ("--n-samples-per-prompt", 8),
    ("--rollout-max-response-len", 8192),
    ("--rollout-temperature", 1.0),
    ("--global-batch-size", 256),
    ("--balance-data", True),
)

GRPO: Args = (
    ("--advantage-estimator", "grpo"),
    ("--use-kl-loss", True),
    ("--kl-loss-coef", 0),
    ("--kl-loss-type", "low_var_kl"),
    ("--entropy-coef", 0.0),
    ("--eps-clip", 0.2),
    ("--eps-clip-high", 0.28),
)

OPTIMIZER: Args = (
    ("--optimizer", "adam"),
    ("--lr", 1e-6),
    ("--lr-decay-style", "constant"),
    ("--weight-decay", 0.1),
    ("--adam-beta1", 0.9),
    ("--adam-beta2", 0.98),
)

ROLLOUT_ENGINE: Args = (("--sglang-mem-fraction-static", 0.7),)

# SGLang's MoE rollout on CUDA: experts spread over the engine's GPUs, all-to-all via DeepEP.
DEEPEP_ROLLOUT_ENGINE: Args = (
    ("--sglang-ep-size", "{rollout_gpus_per_engine}"),
    ("--sglang-moe-a2a-backend", "deepep"),
    ("--sglang-deepep-mode", "auto"),
)

# Megatron memory and kernel settings; the CPU profile removes them (and the recipes' own
# GPU-only perf flags).
PERF: Args = (
    ("--colocate", True),
    ("--bf16", True),
    ("--recompute-granularity", "full"),
    ("--recompute-method", "uniform"),
    ("--recompute-num-layers", 1),
    ("--use-dynamic-batch-size", True),
    ("--max-tokens-per-gpu", 9216),
    ("--attention-dropout", 0.0),
    ("--hidden-dropout", 0.0),
    ("--accumulate-allreduce-grads-in-fp32", True),
    ("--attention-softmax-in-fp32", True),
)

MISC: Args = (("--seed", 1234),)

ENV: tuple[tuple[str, str], ...] = (("PYTHONUNBUFFERED", "1"),)


# Every group's starting flags; a recipe names only what it changes (args_with).
DEFAULT_ARGS = groups(
    checkpoint=CHECKPOINT, rollout=ROLLOUT, grpo=GRPO, optimizer=OPTIMIZER, rollout_engine=ROLLOUT_ENGINE,
    perf=PERF, misc=MISC,
)  # fmt: skip


def args_with(**changes: Args) -> tuple[tuple[str, Args], ...]:
    """The default groups with a recipe's own flags merged into the groups it names: a new flag
    is appended, a changed one keeps its place, a None value removes one."""
    own = dict(groups(**changes))
    return tuple((group, merge(base, own.get(group, ()))) for group, base in DEFAULT_ARGS)


# The CPU lane trains the same recipe on a tiny random checkpoint: 2 gloo ranks, a small
# batch, three rollouts of the trainer's synthetic task; Megatron where the model maps to
# megatron-core's GPTModel (at a layout of its own), FSDP otherwise.
TINY_OVERRIDES = groups(
    checkpoint=(("--save-interval", 3),),
    rollout=(
        ("--prompt-data", "synthetic:fixed"),
        ("--rm-type", "synthetic"),
        ("--apply-chat-template", None),
        ("--rollout-shuffle", None),
        ("--balance-data", None),
        ("--num-rollout", 3),
        ("--rollout-batch-size", 4),
        ("--n-samples-per-prompt", 4),
        ("--global-batch-size", 16),
        ("--rollout-max-response-len", 16),
    ),
    optimizer=(
        ("--optimizer-cpu-offload", None),
        ("--overlap-cpu-optimizer-d2h-h2d", None),
        ("--use-precision-aware-optimizer", None),
        ("--use-distributed-optimizer", None),
    ),
    perf=(
        ("--attention-backend", None),
        ("--transformer-impl", None),
        ("--bf16", None),
        ("--recompute-granularity", None),
        ("--recompute-method", None),
        ("--recompute-num-layers", None),
        ("--use-dynamic-batch-size", None),
        ("--max-tokens-per-gpu", None),
        ("--attention-dropout", None),
        ("--hidden-dropout", None),
        ("--accumulate-allreduce-grads-in-fp32", None),
        ("--attention-softmax-in-fp32", None),
        # GPU-only: the SGLang engine's memory release and weight-push chunking (the built-in
        # engine samples inside the trainer's processes), and a kernel fusion
        ("--colocate", None),
        ("--no-bias-dropout-fusion", None),
        ("--update-weight-buffer-size", None),
        ("--micro-batch-size", 4),  # in perf, where the recipes set theirs, so it replaces it
        ("--distributed-backend", "gloo"),
        ("--num-threads", 1),
    ),
    misc=(("--ci-test", True),),
)


def cpu_tiny_profile(
    parallel: ParallelLayout | None = None, train_backend: str | None = None, *, nodes: int = 1
) -> ParallelProfile:
    """Two gloo ranks on one CPU machine with the trainer's own sampler: data-parallel FSDP, or
    the Megatron backend at `parallel` when `train_backend` is "megatron". `nodes` 2: the same
    two ranks as two nodes of a Ray cluster, one each (miles.recipes.ray_job)."""
    return ParallelProfile(
        platform="cpu",
        nodes=nodes,
        gpus_per_node=2 // nodes,
        model=TINY,
        parallel=parallel or ParallelLayout(),
        rollout_engine="torch",
        overrides=TINY_OVERRIDES,
        suite="stage-b-cpu",
        source="the CPU lane's recipe tests train it on every PR",
        train_backend=train_backend,
    )


# SGLang server arguments the reference's pinned sglang spells otherwise than the lanes' sglang
# 0.5.23, whose ServerArgs field names miles passes (miles.train.sglang_engine.server_kwargs).
SGLANG_RENAMES = (
    renamed(
        "--sglang-cuda-graph-max-bs", "--sglang-cuda-graph-max-bs-decode",
        reason="sglang 0.5.23 splits the CUDA-graph batch limit into decode and prefill; the reference's is the decode one",
    ),
    renamed(
        "--sglang-nsa-decode-backend", "--sglang-dsa-decode-backend",
        reason="sglang 0.5.23 names the sparse-attention (NSA) backends dsa_*",
    ),
    renamed(
        "--sglang-nsa-prefill-backend", "--sglang-dsa-prefill-backend",
        reason="sglang 0.5.23 names the sparse-attention (NSA) backends dsa_*",
    ),
    renamed(
        "--sglang-mamba-scheduler-strategy", "--sglang-mamba-radix-cache-strategy",
        reason="sglang 0.5.23's field for the mamba cache strategy (same choices, extra_buffer among them)",
    ),
    renamed(
        "--sglang-fp8-gemm-backend", "--sglang-fp8-gemm-runner-backend",
        reason="sglang 0.5.23's ServerArgs field behind its --fp8-gemm-backend option; miles passes field names",
    ),
)  # fmt: skip

# What proves a layout of our own (one no upstream run states): megatron-core's own rank grids at
# its world size, for every GPU profile, and a dry start on CPU ranks scaled from it.
OWN_LAYOUT_EVIDENCE = (
    "tests/parallel/test_megatron_agreement.py",
    "tests/megatron/test_megatron_own_layouts.py",
)

# Differences every recipe has from its reference, and why.
COMMON_DEVIATIONS = (
    *SGLANG_RENAMES,
    deviation(
        "--eval-*",
        "--n-samples-per-eval-prompt",
        reason="evaluation is off in the CI recipes (an AIME pass every 20 rollouts outlasts a 3-rollout test); "
        "pass the --eval-* flags with --extra-args to run it",
    ),
    deviation(
        "--use-fault-tolerance",
        "--dump-details",
        "--router-health-*",
        "--rollout-health-check-*",
        reason="operations of the reference's Ray rollout manager (engine restarts, rollout dumps); miles.train "
        "runs its engines in its own processes and has neither",
    ),
    deviation(
        "--num-gpus-per-node",
        reason="the reference tells Ray the node's GPU count; miles starts one rank per GPU of the profile "
        "(--actor-num-gpus-per-node)",
    ),
    deviation(
        "--train-memory-margin-bytes",
        "--save-retain-interval",
        reason="settings of the reference's colocated Ray actors and checkpoint pruning, which miles.train "
        "does not have (a CI run keeps all three of its rollouts' checkpoints)",
    ),
    deviation(
        "--train-backend=megatron",
        reason="miles.train chooses its backend by flag; the reference's train.py is Megatron only",
    ),
    deviation(
        "--seed=1234", reason="Megatron-LM's default seed (1234), stated so every form draws the same batches"
    ),
    deviation(
        "--bf16=on",
        reason="the reference's Megatron backend trains in bf16 unless told --fp16 (megatron_utils/arguments.py "
        "there); miles.train keeps fp32 weights unless told --bf16, so the GPU recipes say it",
    ),
    deviation(
        "env:RAY_EXPERIMENTAL_NOSET_*=1",
        reason="miles sets Ray's NOSET variables (HIP, ROCR, CUDA) for every ROCm job so Ray keeps the runner's "
        "devices (miles.platform.job_env); the reference scripts set some of them, in some paths",
        platforms=("rocm",),
    ),
    deviation(
        "env:HSA_ENABLE_IPC_MODE_LEGACY=1",
        "env:HSA_NO_SCRATCH_RECLAIM=1",
        "env:HIP_FORCE_DEV_KERNARG=1",
        "env:NCCL_MIN_NCHANNELS=112",
        "env:SGLANG_USE_AITER=1",
        "env:SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1",
        "env:SGLANG_MOE_PADDING=1",
        "env:SGLANG_SET_CPU_AFFINITY=1",
        "env:SGLANG_ROCM_FUSED_DECODE_MLA=1",
        "env:TORCHINDUCTOR_MAX_AUTOTUNE=1",
        "env:TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE=1",
        "env:RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0",
        reason="the reference's ROCm image sets these runtime variables (radixark/miles docker/Dockerfile.rocm@"
        "31f1ca961a94); miles' image sets the same values, and miles.platform.job_env puts them in every ROCm job "
        "so a job started outside the image has them too",
        platforms=("rocm",),
    ),
    deviation(
        "env:NCCL_NVLS_ENABLE",
        reason="the reference's launcher probes NVLink with nvidia-smi and sets NCCL_NVLS_ENABLE to the answer; "
        "miles leaves NCCL its own detection on CUDA",
        platforms=("cuda",),
    ),
)
