"""The gradient norm a layout's trainer computes, beside transformers' own on the same tokens.

For the family workers under `torch.distributed.run` (tests/megatron/*_worker.py): the norm of the
gradient of the mean token cross-entropy as miles' Megatron trainer gets it (megatron's DDP, its
forward-backward schedule, its distributed optimizer's norm), each data-parallel rank taking its
share of the batch, and transformers' on the whole batch (what FSDP computes over the HF model).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def grad_norms(model, tc, path: str, tokens: torch.Tensor, positions: torch.Tensor, *, rows: int = 1) -> dict:
    """{"grad_norm", "hf_grad_norm", "grad_norm_rel"} for `model` (this rank's chunk, its weights
    already the checkpoint's at `path`) on `tokens` [batch, seq]; `rows` sequence rows cross a
    pipeline stage per sequence (miles.families.family.Family.pipeline_rows)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from transformers import AutoModelForCausalLM

    from miles.megatron import training
    from tests.support.ckpt import trunk_of

    batch, seq = tokens.shape
    targets = torch.roll(tokens, -1, dims=1)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)
    wrapped = training.wrap_ddp([model], tc)
    optim = SimpleNamespace(
        lr=1e-5, min_lr=0.0, weight_decay=0.0, beta1=0.9, beta2=0.98, eps=1e-8, clip_grad=0.0
    )
    optimizer = training.build_optimizer(wrapped, optim, tc)
    training.connect_schedule(tc, wrapped)

    def forward_step(data, chunk):
        ids, pos, labels = next(data)
        logits = chunk(ids, pos, None)

        def loss_func(out):
            losses = vocab_parallel_cross_entropy(out.float().contiguous(), labels)
            return losses.mean(), {"loss": losses.mean().detach()}

        return logits, loss_func

    model.train()
    for chunk in wrapped:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    training.run_schedule(
        forward_step, wrapped, [(tokens[share], positions[share], targets[share])], seq_length=seq,
        micro_batch_size=(batch // dp) * rows, forward_only=False,
    )  # fmt: skip
    _, norm = training.grads_ready(optimizer)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **trunk_of(path)).train()
    logits = hf(input_ids=tokens).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    want = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters() if p.grad is not None)))
    return {"grad_norm": norm, "hf_grad_norm": want, "grad_norm_rel": abs(norm - want) / want}
