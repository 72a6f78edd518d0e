"""The policy as megatron-core builds it: parallel state, model chunks, DDP, optimizer, weights.

One function per step, each taking and returning plain values, so backend.py reads as the
sequence: parallel state from the layout, a GPTModel per (virtual) pipeline stage from the
HF config, megatron's DDP around each, megatron's distributed optimizer over them, weights
from a torch_dist checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from miles.parallel import ParallelLayout
from miles.train.backends import BackendUnavailable


class MegatronSetupError(BackendUnavailable):
    """The Megatron backend cannot start with these flags; the message names the fix."""


# Megatron model flags and the config.json field each must agree with: the model is built from
# config.json, so a recipe flag that says otherwise describes a different model.
MODEL_FLAGS = (
    ("num_layers", "--num-layers", "num_hidden_layers"),
    ("hidden_size", "--hidden-size", "hidden_size"),
    ("ffn_hidden_size", "--ffn-hidden-size", "intermediate_size"),
    ("num_attention_heads", "--num-attention-heads", "num_attention_heads"),
    ("num_query_groups", "--num-query-groups", "num_key_value_heads"),
    ("kv_channels", "--kv-channels", "head_dim"),
    ("num_experts", "--num-experts", "num_experts"),
    ("moe_ffn_hidden_size", "--moe-ffn-hidden-size", "moe_intermediate_size"),
    ("moe_router_topk", "--moe-router-topk", "num_experts_per_tok"),
    ("norm_epsilon", "--norm-epsilon", "rms_norm_eps"),
)


def check_model_flags(args, config: dict, path: str) -> None:
    """Every Megatron model flag the command sets agrees with config.json, or one error lists them all."""
    from miles.megatron.config import head_dim, num_experts, rope_parameters

    known = {**config, "head_dim": head_dim(config)}
    if "num_local_experts" in config or "num_experts" in config:
        known["num_experts"] = num_experts(config)
    if args.rotary_base is not None:
        pairs = [("--rotary-base", args.rotary_base, "rope_theta", rope_parameters(config)["rope_theta"])]
    else:
        pairs = []
    pairs += [(flag, getattr(args, dest), key, known.get(key)) for dest, flag, key in MODEL_FLAGS]
    wrong = [
        f"{flag} {given} (config.json {key}: {want})"
        for flag, given, key, want in pairs
        if given is not None and want is not None and float(given) != float(want)
    ]
    if wrong:
        raise MegatronSetupError(
            f"{path}/config.json describes another model than the Megatron flags: {'; '.join(wrong)}. The model "
            "is built from config.json; fix the recipe's model flags or point --hf-checkpoint at the right model"
        )


def init_parallel_state(layout: ParallelLayout, seed: int) -> None:
    """megatron-core's process groups for the layout, and its model-parallel RNG streams."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(**layout.initialize_model_parallel_kwargs())
    model_parallel_cuda_manual_seed(seed)


def hf_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def transformer_config_for(args, config: dict, layout: ParallelLayout, *, on_cpu: bool):
    """The TransformerConfig of the run: the HF model's math, the layout, the recipe's MoE switches."""
    import torch

    from miles.megatron.config import transformer_config

    overrides = {}
    if args.moe_router_dtype:
        overrides["moe_router_dtype"] = args.moe_router_dtype
    if args.moe_aux_loss_coeff:
        overrides["moe_aux_loss_coeff"] = args.moe_aux_loss_coeff
        overrides["moe_router_load_balancing_type"] = args.moe_router_load_balancing_type or "aux_loss"
    if args.moe_token_dispatcher_type:
        overrides["moe_token_dispatcher_type"] = args.moe_token_dispatcher_type
    if args.recompute_granularity and not on_cpu:
        overrides["recompute_granularity"] = args.recompute_granularity
        overrides["recompute_method"] = args.recompute_method
        overrides["recompute_num_layers"] = args.recompute_num_layers
    if on_cpu:
        # gloo pairs point-to-point messages first-in first-out per pair of ranks. Batched p2p
        # posts a two-stage pipeline's activation and gradient to the same peer in an order the
        # peer does not mirror (the interleaved schedule swaps them); megatron's unbatched path
        # sends the two directions over two communicators.
        overrides["batch_p2p_comm"] = False
    dtype = torch.bfloat16 if args.bf16 and not on_cpu else torch.float32
    return transformer_config(config, layout, dtype=dtype, on_cpu=on_cpu, initialize=True, **overrides)


def build_chunks(config: dict, tc, vocab_size: int) -> list:
    """This rank's model: one GPTModel per virtual pipeline stage (one without VPP)."""
    from miles.megatron.config import build_model

    if not tc.virtual_pipeline_model_parallel_size:
        return [build_model(config, vocab_size, transformer=tc)]
    return [
        build_model(config, vocab_size, transformer=tc, vp_stage=stage)
        for stage in range(tc.virtual_pipeline_model_parallel_size)
    ]


def wrap_ddp(chunks: Sequence, tc) -> list:
    """megatron's DDP around each chunk: fp32 gradient buffers, reduced for the distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    return [
        DistributedDataParallel(config=tc, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def build_optimizer(wrapped: Sequence, optim_cfg, tc):
    """megatron's distributed optimizer (AdamW): fp32 main parameters and states, sharded over DP."""
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
        use_distributed_optimizer=True,
    )
    return get_megatron_optimizer(config, list(wrapped))


def is_torch_dist_dir(path: str | Path | None) -> bool:
    if not path:
        return False
    path = Path(path)
    return (path / "latest_checkpointed_iteration.txt").is_file() or (path / "metadata.json").is_file()


def torch_dist_release(path: str | Path) -> Path:
    """The directory holding the tensors of a torch_dist checkpoint (its `release/` or itself)."""
    path = Path(path)
    marker = path / "latest_checkpointed_iteration.txt"
    if marker.is_file():
        tag = marker.read_text().strip()
        name = tag if tag == "release" else f"iter_{int(tag):07d}"
        return path / name
    return path


def model_state_template(chunks: Sequence) -> dict:
    """Every chunk's sharded state dict (TE's fp8 `_extra_state` left out: converted weights have none)."""
    state = {}
    for i, chunk in enumerate(chunks):
        sharded = chunk.sharded_state_dict()
        state[f"model{i}"] = {k: v for k, v in sharded.items() if not k.endswith("_extra_state")}
    return state


def load_weights(chunks: Sequence, path: str | Path) -> None:
    """Fill the chunks with the weights of torch_dist checkpoint `path`, resharded to this layout."""
    from megatron.core import dist_checkpointing

    release = torch_dist_release(path)
    loaded = dist_checkpointing.load(model_state_template(chunks), str(release))
    for i, chunk in enumerate(chunks):
        missing, unexpected = chunk.load_state_dict(loaded[f"model{i}"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing:
            raise MegatronSetupError(
                f"{release}: holds no value for {missing[:5]}; is it a GPT torch_dist of this model?"
            )


def freeze_padding_embedding(chunks: Sequence, pad_token_id: int | None) -> None:
    """Hugging Face builds the input embedding with padding_idx = pad_token_id: a lookup of that
    token passes no gradient to its row. Megatron's embedding has no such notion, so the same
    is done here with a forward hook, for the trainer to learn what the HF model would."""
    if pad_token_id is None:
        return
    import torch

    def stop_pad_gradient(module, inputs, output):
        pad = inputs[0] == pad_token_id  # [batch, seq]
        if not bool(pad.any()):
            return output
        if module.reduce_scatter_embeddings:  # output is this rank's sequence slice, [seq/tp, batch, h]
            rows = output.shape[0]
            rank = torch.distributed.get_rank(module.tp_group)
            pad = pad.transpose(0, 1)[rank * rows : (rank + 1) * rows]
        return torch.where(pad.unsqueeze(-1), output.detach(), output)

    for chunk in chunks:
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None:
            embedding.word_embeddings.register_forward_hook(stop_pad_gradient)
