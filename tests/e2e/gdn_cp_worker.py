"""Run under `torch.distributed.run --nproc-per-node N` (argv: gloo | nccl): Qwen3.5's gated delta net
(miles/families/qwen3_5_moe/gdn.py: megatron-core's GatedDeltaNet with the sequence split over N
context-parallel ranks) computes what it computes on the whole sequence: the layer's output, the
gradient of its input and of every parameter of `sum(output)`, the seed's check
(radixark/miles 31f1ca961 tests/e2e/precision/test_qwen3_5_cp_correctness.py) at its sizes (hidden
256, 4 value heads and 2 key heads of 64, a 4-wide conv, 128 tokens per rank). float32 on gloo,
bfloat16 on a GPU (as the seed). Rank 0 prints one `RESULT` line with the largest differences. Not a
test module; tests/e2e/test_gdn_context_parallel.py and its GPU twin launch it.
"""

from __future__ import annotations

import copy
import sys
import warnings

import torch
import torch.distributed as dist

from tests.support.results import emit

HIDDEN, TOKENS_PER_RANK, BATCH = 256, 128, 1


def build(tc, impl: str):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from miles.families.qwen3_5_moe.gdn import gdn_spec
    from miles.megatron.spec import layer_provider

    return build_module(
        gdn_spec(layer_provider(impl)), config=tc, layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )  # fmt: skip


def main() -> None:
    warnings.simplefilter("ignore")
    backend = sys.argv[1]
    dist.init_process_group(backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    on_gpu = backend == "nccl"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    else:
        from miles.megatron import compat

        compat.install()
    from megatron.core.transformer import TransformerConfig

    from miles.megatron.attention import context_parallel_positions
    from miles.megatron.spec import TE, te_status
    from miles.megatron.training import init_parallel_state
    from miles.parallel import ParallelLayout

    dtype = torch.bfloat16 if on_gpu else torch.float32
    init_parallel_state(ParallelLayout(cp=world), seed=42)
    tc = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, normalization="RMSNorm", layernorm_epsilon=1e-6,
        layernorm_zero_centered_gamma=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=not on_gpu,
        perform_initialization=True, context_parallel_size=world,
    )  # fmt: skip
    impl = TE if on_gpu and te_status().ok else "local"
    layer = build(tc, impl).to(device)
    whole = copy.copy(tc)
    whole.context_parallel_size = 1  # the same layer run on the whole sequence
    reference = build(whole, impl).to(device)
    reference.load_state_dict(layer.state_dict())

    total = TOKENS_PER_RANK * world
    x = torch.randn(total, BATCH, HIDDEN, generator=torch.Generator().manual_seed(123)).to(device, dtype)
    full_in = x.clone().requires_grad_(True)
    want, _ = reference(full_in, None)
    want.float().sum().backward()

    mine = context_parallel_positions(total, world, rank).to(device)
    local_in = x[mine].clone().requires_grad_(True)
    got, _ = layer(local_in, None)
    got.float().sum().backward()
    grads = {n: p.grad.float().clone() for n, p in layer.named_parameters()}
    for grad in grads.values():  # each rank's share of the parameter gradients
        dist.all_reduce(grad)
    ref_grads = {n: p.grad.float() for n, p in reference.named_parameters()}
    found = {
        "output": float((got.float() - want.float()[mine]).abs().max()),
        "input_grad": float((local_in.grad.float() - full_in.grad.float()[mine]).abs().max()),
        "param_grad": max(float((grads[n] - ref_grads[n]).abs().max()) for n in grads),
        "output_scale": float(want.float().abs().max()),
        "input_grad_scale": float(full_in.grad.float().abs().max()),
        "param_grad_scale": max(float(g.abs().max()) for g in ref_grads.values()),
    }
    every = [None] * world
    dist.all_gather_object(every, found)
    if rank == 0:
        emit({"cp": world, "dtype": str(dtype), "impl": impl, **{k: max(r[k] for r in every) for k in found}})
    dist.destroy_process_group()


if __name__ == "__main__":
    from miles.train.distributed import exit_process

    main()
    exit_process(0)
