"""The seed's Qwen3.5-35B-A3B MTP case flags (radixark/miles 31f1ca961,
tests/e2e/megatron/test_qwen3_5_35B_A3B_mtp/_common.py build_train_args), for the GPU twins here.

Not a test module. `run(workdir, ...)` prepares Qwen3.5-35B-A3B with the qwen3_5_35b_a3b recipe's
checkpoint plan (download, validation, torch_dist; the vision tower is left out of the megatron
checkpoint by name) and trains it colocated with one SGLang engine on every GPU: one MTP layer
trained (--enable-mtp-training, loss scale 0.2), EAGLE speculative decoding from it with the mamba
scheduler's extra buffer, R3 when asked, the vision weights
skipped in the weight-equality check (miles trains the text decoder). Left out, with why:
"""

from __future__ import annotations

from pathlib import Path

from tests.e2e import seed_flags as twins

LEFT_OUT = {
    "--check-weight-update-selector": "miles compares every weight the engine holds after a sync (the draft's "
    "too, which MTP training syncs); the skip list still leaves the vision tower out",
    "--rematerialize-param-from-master-weight": "an option of the seed's own Megatron fork; megatron-core 0.16.1 "
    "has none",
    "--eval-top-k": "no evaluation in this case (the seed's MILES_TEST_ENABLE_EVAL=0)",
    "--eval-prompt-data": "no evaluation in this case (the seed's MILES_TEST_ENABLE_EVAL=0)",
    "--n-samples-per-eval-prompt": "no evaluation in this case",
    "--eval-max-response-len": "no evaluation in this case",
}

FLAGS = """
--hf-checkpoint {model} --ref-load {ref}
--prompt-data {data}/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt --label-key label --apply-chat-template
--rollout-shuffle --rm-type deepscaler --num-rollout 2 --rollout-batch-size 8 --n-samples-per-prompt 8
--rollout-max-response-len 8192 --rollout-temperature 1 --global-batch-size 32 --balance-data
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer
--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
--eps-clip 0.2 --eps-clip-high 0.28
--tensor-model-parallel-size {tp} --sequence-parallel --pipeline-model-parallel-size {pp} --context-parallel-size {cp}
--expert-model-parallel-size {ep} --expert-tensor-parallel-size 1 --recompute-granularity full
--recompute-method uniform --recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 8192
--eval-prompt-data aime24 {data}/aime-2024/aime-2024.jsonl --n-samples-per-eval-prompt 1 --eval-max-response-len 16384
--eval-top-k 1
--rollout-num-gpus-per-engine {gpus} --sglang-mem-fraction-static 0.6 --sglang-ep-size {sglang_ep}
--sglang-max-running-requests 512 --sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 2
--sglang-speculative-eagle-topk 1 --sglang-speculative-num-draft-tokens 3 --sglang-mamba-scheduler-strategy extra_buffer
{r3}
--enable-mtp-training --mtp-num-layers 1 --mtp-loss-scaling-factor 0.2
--ci-test --check-weight-update-selector all --check-weight-update-skip-list visual
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--attention-backend flash --actor-num-nodes 1 --actor-num-gpus-per-node {gpus} --colocate
--moe-token-dispatcher-type flex --rematerialize-param-from-master-weight
{extra}
--train-backend megatron --rollout-engine sglang
"""
# The seed also sets SGLANG_ENABLE_SPEC_V2=1; the pinned sglang 0.5.23 reads no such variable (no
# module of it names it), so setting it would claim a switch that does nothing.
ENV: dict[str, str] = {}


def run(
    workdir: Path, *, gpus: int, tp: int, pp: int, cp: int, ep: int, sglang_ep: int, r3: bool, extra: str = ""
) -> Path:
    plan = twins.prepared("qwen3_5_35b_a3b", "Qwen3.5-35B-A3B", datasets=("aime-2024",))
    flags = FLAGS.format(
        model="{model}", ref="{ref}", data="{data}", tp=tp, pp=pp, cp=cp, ep=ep, gpus=gpus, sglang_ep=sglang_ep,
        r3="--use-rollout-routing-replay" if r3 else "", extra=extra,
    )  # fmt: skip
    argv = twins.command(flags, plan, LEFT_OUT)
    return twins.train(argv, nproc=gpus, workdir=workdir, env=ENV)
