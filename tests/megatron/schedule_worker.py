"""Run under `torch.distributed.run --nproc-per-node 2 schedule_worker.py HF_DIR TORCH_DIST CASES_JSON`:
for each case (extra trainer flags), the Megatron backend the trainer builds from those flags,
which pipeline schedule megatron-core runs for it (observed with a profiler hook while the
backend computes logprobs and takes a training step) and how many model chunks each rank
holds. Not a test module; tests/megatron/test_megatron_schedule.py launches it."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

from tests.support.results import emit

# megatron-core's three schedules (megatron/core/pipeline_parallel/schedules.py)
SCHEDULES = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)


def entered_schedules(run) -> set[str]:
    """Names of megatron-core's schedule functions entered while `run()` runs (a profiler hook:
    nothing is replaced)."""
    seen: set[str] = set()

    def hook(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name in SCHEDULES:
            if Path(code.co_filename).match("megatron/core/pipeline_parallel/schedules.py"):
                seen.add(code.co_name)

    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def a_batch(vocab: int):
    from miles.train.batch import TokenBatch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (4, 12), generator=gen)
    loss_mask = torch.zeros(4, 11)
    loss_mask[:, 5:] = 1.0
    return TokenBatch(
        ids, torch.ones_like(ids), loss_mask, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.zeros(4, 11)
    )


def main() -> None:
    warnings.simplefilter("ignore")
    hf, torch_dist, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    from megatron.core import parallel_state

    from miles.train.args import parse_config, validate_world
    from miles.train.backends import make_backend
    from miles.train.distributed import init_distributed

    dist_info = init_distributed("gloo")
    results = []
    for extra in cases:
        config = parse_config([
            "--hf-checkpoint", hf, "--ref-load", torch_dist, "--train-backend", "megatron",
            "--actor-num-gpus-per-node", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3", *extra,
        ])  # fmt: skip
        validate_world(config, dist_info.world_size)
        backend = make_backend(config, dist_info)
        batch = a_batch(backend.config["vocab_size"])
        outcome = {}

        def step(backend=backend, batch=batch, outcome=outcome):
            micro = [batch.rows(slice(s, s + 2)) for s in (0, 2)]
            micro = [
                mb.with_(old_logp=old) for mb, old in zip(micro, backend.batch_logprobs(micro), strict=True)
            ]
            result = backend.train_step(micro, normalizer=4.0)
            outcome.update(grad_norm=result.grad_norm, applied=not result.skipped)

        schedules = entered_schedules(step)
        results.append({
            "flags": extra,
            "vpp": config.layout.vpp,
            "schedules": sorted(schedules),
            "chunks": len(backend.chunks),
            "megatron_vpp": parallel_state.get_virtual_pipeline_model_parallel_world_size(),
            **outcome,
        })  # fmt: skip
    if dist_info.is_main:
        emit(results)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from miles.train.distributed import exit_process

    main()
    exit_process(0)
