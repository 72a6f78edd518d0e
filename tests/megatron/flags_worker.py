"""Run under `torch.distributed.run --nproc-per-node 2 flags_worker.py HF_DIR TORCH_DIST CASES_JSON`:
for each case (extra trainer flags), the Megatron backend the trainer builds from them takes
three steps (logprobs, then a training step on them) on the same batch. Reported: the
exported weights' checksum and the first step's loss and grad norm, how often the first
decoder layer's (and its core attention's) forward ran in a training step, the parameters' checksum right after the last
step (before anything gathers them) and the megatron-core settings in force. Not a test
module; tests/megatron/test_megatron_perf_flags.py launches it."""

from __future__ import annotations

import json
import sys
import warnings

import torch

from tests.megatron.schedule_worker import a_batch
from tests.support.results import emit

STEPS = 3


def main() -> None:
    warnings.simplefilter("ignore")
    hf, torch_dist, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    from miles.train.args import parse_config, validate_world
    from miles.train.backends import make_backend
    from miles.train.distributed import init_distributed

    dist_info = init_distributed("gloo")
    results = []
    for extra in cases:
        config = parse_config([
            "--hf-checkpoint", hf, "--ref-load", torch_dist, "--train-backend", "megatron",
            "--actor-num-gpus-per-node", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-2", *extra,
        ])  # fmt: skip
        validate_world(config, dist_info.world_size)
        torch.manual_seed(0)
        backend = make_backend(config, dist_info)
        batch = a_batch(backend.config["vocab_size"])
        calls: list[str] = []
        layer = backend.chunks[0].decoder.layers[0]
        layer.register_forward_hook(lambda *a, seen=calls: seen.append("layer"))
        layer.self_attention.core_attention.register_forward_hook(
            lambda *a, seen=calls: seen.append("attention")
        )
        first = None
        for _ in range(STEPS):
            micro = [batch.rows(slice(s, s + 2)) for s in (0, 2)]
            micro = [
                mb.with_(old_logp=old) for mb, old in zip(micro, backend.batch_logprobs(micro), strict=True)
            ]
            calls.clear()
            result = backend.train_step(micro, normalizer=4.0)
            first = first or {"loss": sum(float(t.loss) for t in result.terms), "grad_norm": result.grad_norm}
        with torch.no_grad():
            params_after_step = sum(float(p.double().sum()) for p in backend.chunks[0].parameters())
            exported = sum(float(t.double().sum()) for _, t in backend.full_weights())
            params_after_export = sum(float(p.double().sum()) for p in backend.chunks[0].parameters())
        ddp, tc = backend.model[0].ddp_config, backend.tc
        results.append({
            "flags": extra,
            **first,
            "exported": exported,
            "params_after_step": params_after_step,
            "params_after_export": params_after_export,
            "layer_forwards_per_step": calls.count("layer"),
            "attention_forwards_per_step": calls.count("attention"),
            "micro_batches": len(micro),
            "overlap_grad_reduce": ddp.overlap_grad_reduce,
            "overlap_param_gather": ddp.overlap_param_gather,
            "bucket_groups": len(backend.model[0].bucket_groups),
            "recompute": [tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers],
        })  # fmt: skip
    if dist_info.is_main:
        emit(results)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from miles.train.distributed import exit_process

    main()
    exit_process(0)
