"""The seed's Qwen3-30B-A3B case flags (radixark/miles 31f1ca961,
tests/e2e/megatron/test_qwen3_30B_A3B/_common.py build_train_args), for the GPU twins here.

Not a test module. `run(workdir, extra, num_rollout)` prepares Qwen3-30B-A3B with the
qwen3_30b_a3b recipe's checkpoint plan and trains it with the case's flags on 6 GPUs, 2 more
serving the rollout (the seed's num_gpus_per_node 6 + rollout_num_gpus 2). Left out, with why:
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("seed_flags", Path(__file__).parents[2] / "seed_flags.py")
twins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(twins)

LEFT_OUT = {
    # the seed's MILES_TEST_TIGHT_HOST_MEMORY default: Megatron-LM's precision-aware optimizer
    # state in fp16; miles' Megatron backend keeps fp32 AdamW state
    "--exp-avg-dtype": "fp32 optimizer state",
    "--exp-avg-sq-dtype": "fp32 optimizer state",
    "--main-params-dtype": "fp32 master weights",
    "--use-routing-replay": "the old-logprob forward's routing replayed in training (R2) is not in miles.train "
    "(it refuses the flag); R3, --use-rollout-routing-replay, is",
    "--eval-top-k": "miles evaluates greedily with --eval-temperature 0; evaluation is off in this case",
    # the seed gives its evaluation set without --eval-interval (MILES_TEST_ENABLE_EVAL=0: never
    # scored); miles.train refuses a set it would never score
    "--eval-prompt-data": "no evaluation in this case (the seed's MILES_TEST_ENABLE_EVAL=0)",
    "--n-samples-per-eval-prompt": "no evaluation in this case",
    "--eval-max-response-len": "no evaluation in this case",
}

FLAGS = """
--hf-checkpoint {model} --ref-load {ref}
--prompt-data {data}/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt --label-key label --apply-chat-template
--rollout-shuffle --rm-type deepscaler --num-rollout {num_rollout} --rollout-batch-size 8 --n-samples-per-prompt 8
--rollout-max-response-len 8192 --rollout-temperature 1 --global-batch-size 32 --balance-data
--eval-prompt-data aime24 {data}/aime-2024/aime-2024.jsonl --n-samples-per-eval-prompt 1 --eval-max-response-len 16384
--eval-top-k 1
--tensor-model-parallel-size 1 --sequence-parallel --pipeline-model-parallel-size 3 --context-parallel-size 2
--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --recompute-granularity full --recompute-method uniform
--recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 8192
--exp-avg-dtype fp16 --exp-avg-sq-dtype fp16 --main-params-dtype fp16
--advantage-estimator gspo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --kl-coef 0.00
--entropy-coef 0.00 --eps-clip 4e-4 --use-tis --use-routing-replay
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer
--rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7 --sglang-max-running-requests 512
--sglang-enable-metrics
--ci-test
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--attention-backend flash --actor-num-nodes 1 --actor-num-gpus-per-node 6 --rollout-num-gpus 2
--update-weight-transfer-mode broadcast --moe-token-dispatcher-type alltoall
--train-backend megatron --rollout-engine sglang
"""

DISAGG_BROADCAST = ""  # the case as test_disagg_broadcast.py sets it: FLAGS alone
FULLY_ASYNC = " --fully-async"  # test_fully_async.py: fully_async=True


def run(workdir: Path, extra: str, num_rollout: int) -> Path:
    plan = twins.prepared("qwen3_30b_a3b", "Qwen3-30B-A3B", datasets=("aime-2024",))
    argv = twins.command(FLAGS + extra, plan, LEFT_OUT, num_rollout=str(num_rollout))
    return twins.train(argv, nproc=6, workdir=workdir)


# The colocated cases (test_baseline.py, test_r3_baseline.py): the case's layout on 4 GPUs, one
# SGLang engine of 4 GPUs sharing them, and the routing flag: --use-rollout-routing-replay with
# use_r3, --use-routing-replay (left out above) without.
COLOCATED_LEFT_OUT = {
    **LEFT_OUT,
    "--rematerialize-param-from-master-weight": "an option of the seed's own Megatron fork; megatron-core 0.16.1 "
    "has none",
    "--mooncake-master-addr": "the Mooncake object store (use_mooncake) is not in miles: weights go to the "
    "colocated engine through SGLang's own update",
}
COLOCATED = """
--tensor-model-parallel-size {tp} --sequence-parallel --pipeline-model-parallel-size {pp} --context-parallel-size {cp}
--expert-model-parallel-size {ep} --expert-tensor-parallel-size 1
--rollout-num-gpus-per-engine 4 --actor-num-gpus-per-node 4 --colocate --rematerialize-param-from-master-weight
{routing}
"""
_PLACEMENT = (
    "--tensor-model-parallel-size 1 --sequence-parallel --pipeline-model-parallel-size 3 --context-parallel-size 2\n"
    "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 "
)


def colocated_flags(*, tp: int, pp: int, cp: int, ep: int, r3: bool) -> str:
    """FLAGS with the case's layout, colocated on 4 GPUs (the disaggregated placement dropped)."""
    kept = []
    for line in FLAGS.replace(_PLACEMENT, "").splitlines():
        for flag in ("--use-routing-replay", "--rollout-num-gpus-per-engine 2", "--actor-num-gpus-per-node 6",
                     "--rollout-num-gpus 2", "--update-weight-transfer-mode broadcast"):  # fmt: skip
            line = line.replace(flag, "")
        kept.append(line)
    routing = "--use-rollout-routing-replay" if r3 else "--use-routing-replay"
    return "\n".join(kept) + COLOCATED.format(tp=tp, pp=pp, cp=cp, ep=ep, routing=routing)


def run_colocated(
    workdir: Path, *, tp: int, pp: int, cp: int, ep: int, r3: bool, num_rollout: int = 2
) -> Path:
    plan = twins.prepared("qwen3_30b_a3b", "Qwen3-30B-A3B", datasets=("aime-2024",))
    flags = colocated_flags(tp=tp, pp=pp, cp=cp, ep=ep, r3=r3)
    argv = twins.command(flags, plan, COLOCATED_LEFT_OUT, num_rollout=str(num_rollout))
    return twins.train(argv, nproc=4, workdir=workdir)


# The FP8-rollout cases with the seed's use_bridge (test_deepep_fp8_bridge.py on 8 H100s,
# test_amd_moriep_fp8_bridge.py on 4 MI350s): the engine starts from the FP8 checkpoint (the seed
# downloads Qwen/Qwen3-30B-A3B-FP8; here prepare-ckpt's fp8 step writes the same 128x128-block
# e4m3 form from the bf16 weights) and every weight update is quantized on its way to it, the
# experts gathered over EP first.
FP8_LEFT_OUT = {
    **COLOCATED_LEFT_OUT,
    "--megatron-to-hf-mode": "Megatron-Bridge is not part of miles (the trainer refuses bridge); the case "
    "starts from the torch_dist checkpoint prepare-ckpt converts, and the trainer's own export hands the "
    "engine its weights, quantized to the FP8 checkpoint's blocks (miles.train.fp8_export)",
    "--check-weight-update-allow-quant-error": "miles' --ci-test weight check quantizes the trainer's tensors "
    "as the FP8 engine receives them and compares exactly: there is no quantization error to allow",
}
FP8 = """
--hf-checkpoint {fp8} --ref-load {ref}
--prompt-data {data}/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt --label-key label --apply-chat-template
--rollout-shuffle --rm-type deepscaler --num-rollout 2 --rollout-batch-size 8 --n-samples-per-prompt 8
--rollout-max-response-len 8192 --rollout-temperature 1 --global-batch-size 32 --balance-data
--eval-prompt-data aime24 {data}/aime-2024/aime-2024.jsonl --n-samples-per-eval-prompt 1 --eval-max-response-len 16384
--eval-top-k 1
--tensor-model-parallel-size {tp} --sequence-parallel --pipeline-model-parallel-size {pp} --context-parallel-size {cp}
--expert-model-parallel-size {ep} --expert-tensor-parallel-size 1 --recompute-granularity full --recompute-method uniform
--recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 2048
--exp-avg-dtype fp16 --exp-avg-sq-dtype fp16 --main-params-dtype fp16
--advantage-estimator gspo --kl-loss-coef 0.00 --kl-loss-type low_var_kl --kl-coef 0.00
--entropy-coef 0.00 --eps-clip 4e-4 --use-tis --use-routing-replay
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer
--rollout-num-gpus-per-engine {gpus} --sglang-mem-fraction-static 0.7 --sglang-max-running-requests 512
--sglang-enable-metrics --sglang-moe-a2a-backend {a2a} --sglang-deepep-mode auto --sglang-ep-size {gpus}
--ci-test --check-weight-update-allow-quant-error
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--attention-backend flash --actor-num-nodes 1 --actor-num-gpus-per-node {gpus} --colocate
--rematerialize-param-from-master-weight --megatron-to-hf-mode bridge --moe-token-dispatcher-type alltoall
--train-backend megatron --rollout-engine sglang
"""
# The seed's --sglang-expert-parallel-size is ServerArgs' ep_size, which miles passes by its field
# name. The trainer dispatches all-to-all in both forms: the seed's CUDA case trains with
# megatron-core's flex dispatcher (--moe-token-dispatcher-type flex --moe-enable-deepep), which
# needs the deep_ep kernels the lane's image does not build; its AMD case already trains all-to-all.


def fp8_plan():
    """The case's checkpoints with the fp8 step, whatever the platform's recipe form rolls out from
    (the ROCm form's rollout is bf16)."""
    return twins.prepared("qwen3_30b_a3b", "Qwen3-30B-A3B", datasets=("aime-2024",), steps=("fp8",))


def fp8_argv(plan, *, a2a: str, gpus: int, tp: int, pp: int, cp: int, ep: int) -> list[str]:
    """The FP8 bridge case's trainer flags on `gpus` GPUs, one colocated engine of all of them with
    SGLang's `a2a` MoE all-to-all (deepep on CUDA, mori on ROCm)."""
    values = dict(fp8=plan.fp8_dir, a2a=a2a, gpus=str(gpus), tp=str(tp), pp=str(pp), cp=str(cp), ep=str(ep))
    return twins.command(FP8, plan, FP8_LEFT_OUT, **values)


def run_fp8(workdir: Path, case: dict, env=None) -> Path:
    """Prepare and train one FP8 bridge case (fp8_argv's keywords)."""
    return twins.train(fp8_argv(fp8_plan(), **case), nproc=case["gpus"], workdir=workdir, env=env)
