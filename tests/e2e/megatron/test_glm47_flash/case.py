"""The seed's GLM-4.7-Flash R3 + MTP case flags (radixark/miles 31f1ca961,
tests/e2e/megatron/test_glm47_flash/_common.py build_train_args and execute), for the GPU twins here.

Not a test module. `run(workdir, tp=, pp=, cp=, ep=, gpus=)` prepares GLM-4.7-Flash with the
glm47_flash recipe's checkpoint plan and trains it with the case's flags on `gpus` GPUs, one
colocated SGLang engine of 4 GPUs, 2 rollouts, routing replay on and the MTP layer trained with
EAGLE speculation in the rollout, as the seed's case does. The seed's execute() loosens its R3
mismatch threshold to 0.05 (MILES_TEST_R3_THRESHOLD); miles' --ci-test holds the train/rollout gap
to --ci-logprob-abs-diff-tol, given that value. Left out, with why:
"""

from __future__ import annotations

from pathlib import Path

from tests.e2e import seed_flags as twins

LEFT_OUT = {
    # the seed's MILES_TEST_TIGHT_HOST_MEMORY default: Megatron-LM's precision-aware optimizer
    # state in fp16; miles' Megatron backend keeps fp32 AdamW state
    "--exp-avg-dtype": "fp32 optimizer state",
    "--exp-avg-sq-dtype": "fp32 optimizer state",
    "--main-params-dtype": "fp32 master weights",
    # the seed gives its evaluation set without --eval-interval (MILES_TEST_ENABLE_EVAL=0: never
    # scored); miles.train refuses a set it would never score
    "--eval-prompt-data": "no evaluation in this case (the seed's MILES_TEST_ENABLE_EVAL=0)",
    "--n-samples-per-eval-prompt": "no evaluation in this case",
    "--eval-max-response-len": "no evaluation in this case",
    "--eval-top-k": "no evaluation in this case",
}


def _parsed(flag: str) -> bool:
    from miles.train.args import build_parser

    return any(flag in action.option_strings for action in build_parser()._actions)


def left_out() -> dict[str, str]:
    """LEFT_OUT, and the MTP training flags while miles.train has no MTP training (the family then
    carries the MTP layer frozen: converted, handed to SGLang for the speculation, not trained)."""
    out = dict(LEFT_OUT)
    if not _parsed("--enable-mtp-training"):
        reason = "miles.train does not train MTP layers yet; glm4_moe_lite carries its MTP layer frozen"
        out |= {"--enable-mtp-training": reason, "--mtp-loss-scaling-factor": reason}
    return out


FLAGS = """
--hf-checkpoint {model} --ref-load {ref}
--prompt-data {data}/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt --label-key label --apply-chat-template
--rollout-shuffle --rm-type deepscaler --num-rollout 2 --rollout-batch-size 8 --n-samples-per-prompt 8
--rollout-max-response-len 8192 --rollout-temperature 1 --global-batch-size 32
--eval-prompt-data aime24 {data}/aime-2024/aime-2024.jsonl --n-samples-per-eval-prompt 1 --eval-max-response-len 16384
--eval-top-k 1
--tensor-model-parallel-size {tp} --sequence-parallel --pipeline-model-parallel-size {pp} {last_stage}
--context-parallel-size {cp} --expert-model-parallel-size {ep} --expert-tensor-parallel-size 1
--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --use-dynamic-batch-size
--max-tokens-per-gpu 8192
--exp-avg-dtype fp16 --exp-avg-sq-dtype fp16 --main-params-dtype fp16
--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
--eps-clip 0.2 --eps-clip-high 0.28 --use-rollout-routing-replay
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer
--rollout-num-gpus-per-engine 4 --sglang-mem-fraction-static 0.7
--sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 2 --sglang-speculative-eagle-topk 1
--sglang-speculative-num-draft-tokens 3
--enable-mtp-training --mtp-loss-scaling-factor 0.2
--ci-test --ci-logprob-abs-diff-tol 0.05
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--attention-backend flash --actor-num-nodes 1 --actor-num-gpus-per-node {gpus} --colocate
--moe-token-dispatcher-type alltoall
--train-backend megatron --rollout-engine sglang
"""


def flags(*, tp: int, pp: int, cp: int, ep: int, gpus: int) -> str:
    """The case's flags at its layout (the seed splits 47 layers 24 + 23 under PP 2)."""
    last_stage = "--decoder-last-pipeline-num-layers 23" if pp == 2 else ""
    return (
        FLAGS.replace("{last_stage}", last_stage)
        .replace("{tp}", str(tp))
        .replace("{pp}", str(pp))
        .replace("{cp}", str(cp))
        .replace("{ep}", str(ep))
        .replace("{gpus}", str(gpus))
    )


def run(workdir: Path, *, tp: int, pp: int, cp: int, ep: int, gpus: int) -> Path:
    plan = twins.prepared("glm47_flash", "GLM-4.7-Flash", datasets=("aime-2024",))
    argv = twins.command(flags(tp=tp, pp=pp, cp=cp, ep=ep, gpus=gpus), plan, left_out())
    return twins.train(argv, nproc=gpus, workdir=workdir)
