"""The reference recipes (radixark/miles) as facts: one module per recipe, `CUDA` and `ROCM`.

Each `Reference` lists the trainer flags the reference script passes for the shape the CI
runs (paths as {fields}), the environment it and its launcher set, and the layouts it states
per GPU count, read at the commit named in `script`. Nothing here is code from there; see
miles.recipes.fidelity for how a recipe is compared with it.
"""

from miles.recipes.fidelity import flags

# Flags every reference script passes in the same form (its launcher adds the environment).
LAUNCHER_ENV = (("CUDA_DEVICE_MAX_CONNECTIONS", "1"), ("PYTHONUNBUFFERED", "1"))
AMD_ENV = (
    ("RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES", "1"),
    ("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1"),
    ("NCCL_NVLS_ENABLE", "0"),
)
OPTIMIZER = flags(
    "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98"
)
OPTIMIZER_OFFLOAD = flags(
    "--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer"
)
RECOMPUTE = flags("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
MEGATRON_MISC = flags(
    "--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32"
)
DAPO = flags(
    "--prompt-data {data_dir}/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt --label-key label "
    "--apply-chat-template --rollout-shuffle"
)
AIME_EVAL = flags(
    "--eval-interval 20 --eval-prompt-data aime {data_dir}/aime-2024/aime-2024.jsonl --n-samples-per-eval-prompt 16 "
    "--eval-max-response-len 16384"
)
CHECKPOINT = flags(
    "--hf-checkpoint {hf_checkpoint} --ref-load {ref_load} --load {save_dir} --save {save_dir} --save-interval 20"
)
