"""GPU twin of the seed's tests/e2e/short/test_dumper.py (radixark/miles 31f1ca961): one rollout of one
sample of Qwen3-30B-A3B on 8 GPUs at TP2·SP·PP2·CP2·EP2·ETP2, the tensor dumps of the logprob
forward (fwd_only) and the training forward-backward (fwd_bwd) filtered to layers 0-2 and 24, then
the dump folders checked: each phase has .pt files holding `value` and `meta`, with the inputs and
layer outputs named. The seed also dumps the SGLang engines (`--dumper-inference`) and edits
megatron-core's source to dump named internals (`--dumper-source-patcher-config-*`), then compares
engine and trainer tensors with SGLang's comparator; miles refuses those flags (no rollout engine
dumps yet, no source patcher in the trainer), so they are left out and the comparison with them.
The CPU twin (files, manifests, and logits equal to the model's) is tests/e2e/test_train_dumps.py.
Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=1100, suite="stage-c-8-gpu-h100", labels=["short"])
register_rocm_ci(est_time=1800, suite="nightly-stage-c-8-gpu-mi350", labels=["short"])

_spec = importlib.util.spec_from_file_location("seed_flags", Path(__file__).parents[1] / "seed_flags.py")
twins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(twins)

GPUS = 8
FILTER = "filter=layer_id is None or layer_id < 3 or layer_id == 24"
LEFT_OUT = {
    "--sglang-dp-size": "a workaround for colocated DP attention the seed needs for its engine dumps, left out with them",
    "--sglang-enable-dp-attention": "as --sglang-dp-size",
    "--optimizer-cpu-offload": "miles offloads between phases (--offload-train), not the optimizer step",
    "--use-precision-aware-optimizer": "as --optimizer-cpu-offload",
    "--use-rollout-routing-replay": "routing replay (the engine's expert choices replayed in training) is not in miles",
    "--qkv-format": "miles' micro-batches are padded rows (bshd) already; there is no packed (thd) form to switch from",
}
COMMON = f"""
--hf-checkpoint {{model}} --ref-load {{ref}}
--prompt-data {{data}}/gsm8k/train.parquet --input-key messages --label-key label --apply-chat-template
--rollout-shuffle --rm-type math --rollout-max-response-len 3 --rollout-temperature 0.8
--num-rollout 1 --rollout-batch-size 1 --n-samples-per-prompt 2 --global-batch-size 2
--optimizer adam --lr 1e-6 --lr-decay-style constant --optimizer-cpu-offload --use-precision-aware-optimizer
--advantage-estimator grpo --eps-clip 0.2
--rollout-num-gpus-per-engine 4 --sglang-mem-fraction-static 0.6 --sglang-dp-size 4 --sglang-enable-dp-attention
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--attention-backend flash --actor-num-nodes 1 --actor-num-gpus-per-node {GPUS} --colocate
--moe-token-dispatcher-type alltoall --use-rollout-routing-replay
--train-backend megatron --rollout-engine sglang
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --context-parallel-size 2
--expert-model-parallel-size 2 --expert-tensor-parallel-size 2
"""
# --n-samples-per-prompt 2: the seed's one sample is refused by GRPO's group normalisation here
MODES = {
    "tp2_pp2_cp2_ep2_etp2": "--use-dynamic-batch-size --max-tokens-per-gpu 2048",
    "tp2_pp2_cp2_ep2_etp2_bshd": "--qkv-format bshd --micro-batch-size 1",
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_dumps_hold_each_phases_inputs_and_layer_outputs(tmp_path, mode):
    plan = twins.prepared("qwen3_30b_a3b", "Qwen3-30B-A3B", datasets=("gsm8k",))
    dumps = tmp_path / "dumps" / mode
    flags = f"{COMMON} {MODES[mode]} --dumper-enable --dumper-dir {dumps}"
    argv = [*twins.command(flags, plan, LEFT_OUT), "--dumper-fwd-only", FILTER, "--dumper-fwd-bwd", FILTER]
    twins.train(argv, nproc=GPUS, workdir=tmp_path)
    for phase in ("fwd_only", "fwd_bwd"):
        folder = dumps / phase / "rollout_0"
        files = sorted(folder.glob("*.pt"))
        assert files, f"no dumps in {folder}"
        sample = torch.load(files[0], weights_only=False)
        assert set(sample) == {"value", "meta"}
        names = {f.name for f in files}
        assert any("___name=input_ids" in n for n in names), phase
        assert any("___name=decoder.layers.0.output" in n for n in names), phase
        layers = {int(n.split("___layer_id=")[1][:-3]) for n in names if "___layer_id=" in n}
        assert layers <= {0, 1, 2, 24}, layers  # the filter's layers only
