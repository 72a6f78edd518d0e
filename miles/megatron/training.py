"""What the Megatron training backend asks of megatron-core: parallel state, DDP, optimizer, schedules.

One function per step, each taking and returning plain values, so the backend
(`miles.train.backends.megatron`) reads as the sequence: parallel state from the layout,
megatron's DDP around each model chunk, megatron's distributed optimizer over them, the
micro-batches through megatron's forward-backward schedule, the optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from miles.parallel import ParallelLayout


def init_parallel_state(layout: ParallelLayout, seed: int | None = None, *, gloo_groups: bool = True) -> None:
    """megatron-core's process groups for the layout (the layout's one translation), and, with
    `seed`, its model-parallel RNG streams. `gloo_groups=False` skips the extra gloo groups
    megatron-core makes beside NCCL ones (on CPU the default groups are gloo already)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        **layout.initialize_model_parallel_kwargs(), create_gloo_process_groups=gloo_groups
    )
    if seed is not None:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def data_parallel() -> tuple[int, int, object]:
    """(rank, size, process group) of this rank's data-parallel dimension."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()


def context_parallel_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_rank()


def check_expert_replicas(module, tc) -> None:
    """Refuse expert weights DDP would let drift apart.

    megatron-core sends an expert weight to the expert-data-parallel reduction only when it is
    marked `allreduce = False`, which its expert layers do only with expert_model_parallel_size
    > 1 (tensor_parallel/layers.py, moe/experts.py and TE's grouped linear read
    `expert_parallel`); a weight left `allreduce = True` is reduced over data parallel alone,
    as a dense one. With ep = 1 and etp < tp, each expert is copied on tp/etp ranks of a
    tensor-parallel group, and under sequence parallelism each copy sees only its rank's
    tokens: the copies get different gradients, nobody sums them, and they drift apart (a
    tiny Qwen3-MoE at tp2·etp1 on two ranks: gradient norm 1e-5 off FSDP's at the first step,
    0.7% at the third, and trainer and rollout logprobs 1.4e-3 apart after one step).
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer

    tp = tc.tensor_model_parallel_size
    etp = tc.expert_tensor_parallel_size or tp
    if etp >= tp or not tc.sequence_parallel:
        return
    routed = (
        (f"{where}.experts." if where else "experts.") + name
        for where, layer in module.named_modules()
        if isinstance(layer, MoELayer)
        for name, param in layer.experts.named_parameters()
        if getattr(param, "allreduce", True)
    )
    name = next(routed, None)
    if name is not None:
        raise ValueError(
            f"expert weight {name} is copied on the {tp // etp} ranks of each tensor-parallel group "
            f"(tp {tp}, etp {etp}), each copy trained on its rank's sequence-parallel tokens, but "
            f"megatron-core reduces it over data parallel only (it marks expert weights for the "
            f"expert-data-parallel reduction only with expert_model_parallel_size > 1): the copies "
            f"would drift apart; use --expert-tensor-parallel-size {tp} or --expert-model-parallel-size >= 2"
        )


def wrap_ddp(chunks: Sequence, tc, fields: dict | None = None) -> list:
    """megatron's DDP around each chunk, for the distributed optimizer; `fields` are the
    DistributedDataParallelConfig fields the flags set (miles.megatron.options.ddp_fields)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    for chunk in chunks:
        check_expert_replicas(chunk, tc)
    ddp_config = DistributedDataParallelConfig(**{"use_distributed_optimizer": True, **(fields or {})})
    return [
        DistributedDataParallel(config=tc, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def build_optimizer(wrapped: Sequence, optim_cfg, tc, fields: dict | None = None):
    """megatron's distributed optimizer (AdamW: Transformer Engine's FusedAdam where TE imports,
    torch's otherwise): fp32 main parameters and states, sharded over DP. `optim_cfg` carries
    lr, min_lr, weight_decay, beta1, beta2, eps and clip_grad; `fields` the OptimizerConfig
    fields the flags set (miles.megatron.options.optimizer_fields)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=optim_cfg.lr,
        min_lr=optim_cfg.min_lr,
        weight_decay=optim_cfg.weight_decay,
        adam_beta1=optim_cfg.beta1,
        adam_beta2=optim_cfg.beta2,
        adam_eps=optim_cfg.eps,
        clip_grad=optim_cfg.clip_grad,
        bf16=tc.bf16,
        params_dtype=tc.params_dtype,
        **{"use_distributed_optimizer": True, **(fields or {})},
    )
    return get_megatron_optimizer(config, list(wrapped))


def connect_schedule(tc, wrapped: Sequence) -> None:
    """What megatron's schedule calls around the micro-batches: no gradient sync until the
    last one, then the DP/SP/embedding gradient reductions; with overlapped gradient reduction,
    the pipeline schedules start each chunk's reduction as its last backward ends (as
    Megatron-LM sets them)."""
    from megatron.core.distributed import finalize_model_grads

    def one_or_list(funcs: list):
        return funcs[0] if len(funcs) == 1 else funcs

    tc.no_sync_func = one_or_list([m.no_sync for m in wrapped])
    if wrapped and wrapped[0].ddp_config.overlap_grad_reduce:
        tc.grad_sync_func = one_or_list([m.start_grad_sync for m in wrapped])
    tc.finalize_model_grads_func = finalize_model_grads
    tc.grad_scale_func = None


def gather_params(wrapped: Sequence) -> None:
    """The model's parameters up to date with the optimizer's shards. With overlapped parameter
    gathering, a step leaves them stale until megatron's next forward gathers them; whatever
    reads them outside a training forward (the weight export, a save, a forward that no
    zero_grad preceded) needs them gathered now, as Megatron-LM's force_param_sync does."""
    for chunk in wrapped:
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def schedule_name() -> str:
    """The forward-backward schedule megatron-core runs for the parallel state."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func().__name__


def run_schedule(
    forward_step: Callable,
    chunks: Sequence,
    micro: Sequence,
    *,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
) -> list:
    """The micro-batches through megatron's forward-backward schedule (each chunk reads its own
    iterator over them); the last pipeline stage's loss outputs, on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    iterators = [iter(micro) for _ in chunks]
    results = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=list(chunks),
        num_microbatches=len(micro),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    if ps.get_pipeline_model_parallel_world_size() > 1:
        box = [results if ps.is_pipeline_last_stage(ignore_virtual=True) else None]
        last = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[-1]
        dist.broadcast_object_list(box, src=last, group=ps.get_pipeline_model_parallel_group())
        results = box[0]
    return results


def grads_ready(optimizer) -> tuple[bool, float]:
    """Unscale and check the gradients for the step: (whether an inf or NaN was found, grad norm)."""
    found_inf = optimizer.prepare_grads()
    return bool(found_inf), float(optimizer.get_grad_norm() or 0.0)


def apply_step(optimizer, clip_grad: float, grad_norm: float) -> bool:
    """Clip the gradients to `clip_grad` by their total norm (0: no clipping) and step; returns
    whether megatron's optimizer applied the step."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if clip_grad > 0:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = opt.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm=clip_grad, total_norm=grad_norm)
    return bool(optimizer.step_with_ready_grads())


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
