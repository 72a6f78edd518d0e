"""One rank of tests/e2e/test_train_lora.py (torchrun, 2 ranks): LoRA on a training backend.

    python -m torch.distributed.run --nproc-per-node 2 lora_worker.py BACKEND HF_DIR [REF_LOAD] OUT_DIR

Builds the policy backend from a trainer command with --lora-rank 4 --lora-alpha 8, trains three
optimizer steps on fixed samples with random advantages, checkpoints, then builds a second backend
and loads the checkpoint. Writes per rank `lora-<rank>.pt`: the weights handed to the rollout
engine before and after training (merged, under the transformers class's names), which parameters
require gradients, the gradient norms, and the second backend's export after the load.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _samples(count: int):
    from miles.train.batch import Sample
    from miles.train.rollout import Generation

    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(count):
        prompt = tuple(int(t) for t in torch.randint(3, 200, (5,), generator=g))
        response = tuple(int(t) for t in torch.randint(3, 200, (4,), generator=g))
        advantage = float(torch.randn(1, generator=g))
        out.append(Sample(i, i, Generation(prompt, response, (-1.0,) * 4, "length"), "", "", 0.0, advantage))
    return out


def main() -> None:
    backend_name, hf, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    out = Path(rest[-1])
    from miles.train.args import parse_config
    from miles.train.backends import make_backend
    from miles.train.batch import collate
    from miles.train.distributed import init_distributed

    argv = [
        "--hf-checkpoint", hf, "--train-backend", backend_name, "--actor-num-gpus-per-node", "2",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--lora-rank", "4", "--lora-alpha", "8",
        "--lr", "1e-2", "--weight-decay", "0",
    ]  # fmt: skip
    if backend_name == "megatron":
        argv += ["--ref-load", rest[0], "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    config = parse_config(argv)
    dist_info = init_distributed("gloo")
    torch.manual_seed(0)
    backend = make_backend(config, dist_info)
    rank, size, _ = backend.data_parallel
    before = {k: v.clone() for k, v in backend.full_weights()}
    trainable = sorted(name for name, p in _params(backend) if p.requires_grad)
    frozen_before = {name: _whole(p) for name, p in _params(backend) if not p.requires_grad}
    batch = collate(_samples(8))
    mine = batch.rows(list(range(rank, 8, size)))
    norms = [backend.train_step([mine], normalizer=float(mine.size)).grad_norm for _ in range(3)]
    after = {k: v.clone() for k, v in backend.full_weights()}
    frozen_after = {name: _whole(p) for name, p in _params(backend) if not p.requires_grad}
    adapters = {name: _whole(p) for name, p in _params(backend) if p.requires_grad}
    ckpt = out / "ckpt"
    if dist.get_rank() == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    backend.save(str(ckpt), with_optimizer=True)
    dist.barrier()
    torch.manual_seed(1)  # other adapter initial values: the load must replace them
    again = make_backend(config, dist_info)
    again.load(str(ckpt), with_optimizer=True)
    loaded = {k: v.clone() for k, v in again.full_weights()}
    torch.save(
        {
            "before": before,
            "after": after,
            "loaded": loaded,
            "trainable": trainable,
            "norms": norms,
            "frozen_before": frozen_before,
            "frozen_after": frozen_after,
            "adapters": adapters,
        },  # fmt: skip
        out / f"lora-{dist.get_rank()}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()


def _whole(param) -> torch.Tensor:
    """A parameter's full tensor (FSDP shards gathered; a Megatron rank's own TP shard)."""
    tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
    return tensor.detach().clone()


def _params(backend):
    if hasattr(backend, "chunks"):
        return [(n, p) for chunk in backend.chunks for n, p in chunk.named_parameters()]
    return list(backend.model.named_parameters())


if __name__ == "__main__":
    main()
