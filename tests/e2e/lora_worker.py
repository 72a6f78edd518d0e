"""One rank of tests/e2e/test_train_lora.py (torchrun, 2 ranks): LoRA on a training backend.

    python -m torch.distributed.run --nproc-per-node 2 lora_worker.py BACKEND HF_DIR [REF_LOAD] OUT_DIR
    python -m torch.distributed.run --nproc-per-node N lora_worker.py loss BACKEND HF_DIR REF_LOAD CKPT OUT_DIR

Builds the policy backend from a trainer command with --lora-rank 4 --lora-alpha 8, trains three
optimizer steps on fixed samples with random advantages, checkpoints, then builds a second backend
and loads the checkpoint. Writes per rank `lora-<rank>.pt`: the weights handed to the rollout
engine before and after training (merged, under the transformers class's names), which parameters
require gradients, the gradient norms, how many numbers the optimizer steps against the adapters',
and the second backend's export after the load, and its first-step loss on fixed samples.

`loss` mode builds one backend on N ranks (Megatron: tensor parallelism N; fsdp: one rank), gives
it the adapters of checkpoint CKPT (Megatron: its adapters, resharded to this layout; fsdp: the
PEFT-format copy beside them) and writes `loss.pt`: its first-step loss on the same fixed samples.
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


def _first_step_loss(backend) -> tuple[float, torch.Tensor]:
    """The loss of one optimizer step over all the fixed samples (every rank takes all of them),
    and the token logprobs it was computed from. The old logprobs are fixed ones, so the policy
    ratio (and the loss) depends on the model, not only on the advantages."""
    from dataclasses import replace

    from miles.train.batch import collate

    batch = collate(_samples(8))
    batch = replace(batch, old_logp=torch.full_like(batch.rollout_logp, -5.5))
    result = backend.train_step([batch], normalizer=float(batch.size))
    return sum(float(t.loss) for t in result.terms), result.logprobs[0]


def _logprobs(backend) -> torch.Tensor:
    """The policy's token logprobs of all the fixed samples (no step taken)."""
    from miles.train.batch import collate

    batch = collate(_samples(8))
    return backend.logprobs(batch) * batch.loss_mask


def loss_main() -> None:
    backend_name, hf, ref_load, ckpt, out = sys.argv[2:7]
    from miles.train.args import parse_config
    from miles.train.backends import make_backend
    from miles.train.distributed import init_distributed

    dist_info = init_distributed("gloo")
    argv = [
        "--hf-checkpoint", hf, "--train-backend", backend_name, "--actor-num-gpus-per-node", str(dist_info.world_size),
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--lora-rank", "4", "--lora-alpha", "8",
        "--lr", "1e-2", "--weight-decay", "0",
    ]  # fmt: skip
    if backend_name == "megatron":
        argv += ["--ref-load", ref_load, "--tensor-model-parallel-size", str(dist_info.world_size)]
    backend = make_backend(parse_config(argv), dist_info)
    if backend_name == "megatron":
        backend.load(ckpt, with_optimizer=False)
    else:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        result = set_peft_model_state_dict(
            backend.model, load_file(f"{ckpt}/adapter/adapter_model.safetensors")
        )
        assert not result.unexpected_keys, result.unexpected_keys
    loss, logprobs = _first_step_loss(backend)
    if dist.get_rank() == 0:
        torch.save({"loss": loss, "logprobs": logprobs}, Path(out) / "loss.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    if sys.argv[1] == "loss":
        loss_main()
        return
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
    base_logprobs = _logprobs(backend)
    before = {k: v.clone() for k, v in backend.full_weights()}
    trainable = sorted(name for name, p in _params(backend) if p.requires_grad)
    trainable_numel = sum(p.numel() for _, p in _params(backend) if p.requires_grad)
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
    loaded_loss, loaded_logprobs = _first_step_loss(again)
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
            "trainable_numel": trainable_numel,
            "optimizer_numel": _optimizer_numel(backend),
            "loaded_loss": loaded_loss,
            "loaded_logprobs": loaded_logprobs,
            "base_logprobs": base_logprobs,
        },  # fmt: skip
        out / f"lora-{dist.get_rank()}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()


def _optimizer_numel(backend) -> int:
    """How many numbers the optimizer holds parameters for (megatron's: this rank's fp32 shards)."""
    chained = getattr(backend.optimizer, "chained_optimizers", [backend.optimizer])
    inner = [getattr(opt, "optimizer", opt) for opt in chained]
    return sum(p.numel() for opt in inner for group in opt.param_groups for p in group["params"])


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
