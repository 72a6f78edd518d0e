"""Run under `torch.distributed.run --nproc-per-node 2`: vocabulary-parallel logprobs and entropy
(miles.megatron.loss) against the full-vocabulary computation, values and
gradients. Not a test module; tests/megatron/test_megatron_loss.py launches it."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from tests.support.results import emit


def main() -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    from megatron.core import parallel_state

    from miles.megatron import compat, loss
    from miles.megatron.loss import unfused_vocab_parallel_logprobs, vocab_parallel_logprobs
    from miles.train.algorithm import token_logprobs_and_entropy

    compat.install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = parallel_state.get_tensor_model_parallel_rank()
    padded, real, temperature = 64, 61, 0.7  # the last 3 rows are megatron's vocabulary padding
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(3, 5, padded, generator=gen) * 3
    targets = torch.randint(0, real, (3, 5), generator=gen)
    w_logp, w_ent = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)

    loss.BLOCK_BYTES = 4 * 32 * 4  # blocks of 4 tokens: the 15 tokens take four, the last one short
    shard = full[..., rank * 32 : (rank + 1) * 32].clone().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs(shard, targets, temperature, real, with_entropy=True)
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    grads = [torch.empty_like(shard) for _ in range(2)]
    dist.all_gather(grads, shard.grad.contiguous())

    unfused_in = shard.detach().clone().requires_grad_(True)
    u_logp, u_ent = unfused_vocab_parallel_logprobs(unfused_in, targets, temperature, real, with_entropy=True)
    ((u_logp * w_logp).sum() + (u_ent * w_ent).sum()).backward()
    alone, _ = vocab_parallel_logprobs(shard.detach(), targets, temperature, real, with_entropy=False)

    ref_in = full[..., :real].clone().requires_grad_(True)
    ref_logp, ref_ent = token_logprobs_and_entropy(ref_in, targets, temperature)
    ((ref_logp * w_logp).sum() + (ref_ent * w_ent).sum()).backward()
    grad = torch.cat(grads, dim=-1)
    result = {
        "logp": float((logp - ref_logp).abs().max()),
        "entropy": float((ent - ref_ent).abs().max()),
        "grad": float((grad[..., :real] - ref_in.grad).abs().max()),
        "padded_grad": float(grad[..., real:].abs().max()),
        # float32 to 1e-6 (absolute, and relative above 1: one float32 step of a logprob of -10 is 9.5e-7)
        "fused_vs_unfused": [
            bool(torch.allclose(a, b, rtol=1e-6, atol=1e-6))
            for a, b in ((logp, u_logp), (ent, u_ent), (shard.grad, unfused_in.grad), (alone, u_logp))
        ],
        "fused_vs_unfused_max_abs": max(
            float((logp - u_logp).abs().max()),
            float((ent - u_ent).abs().max()),
            float((shard.grad - unfused_in.grad).abs().max()),
        ),
    }
    if rank == 0:
        emit(result)
    dist.destroy_process_group()


if __name__ == "__main__":
    from miles.train.distributed import exit_process

    main()
    exit_process(0)
