"""The Megatron parallel layout a trainer command asks for, checked by `miles.parallel`.

Standard library only: the flag parser calls it before torch is imported, so an impossible
layout fails in the first second, on any machine, with the nearest valid change named.
"""

from __future__ import annotations

import json
from pathlib import Path


class VirtualPipelineError(ValueError):
    """--num-layers-per-virtual-pipeline-stage that Megatron-LM cannot turn into a vpp degree."""


def parallel_layout(args, world_size: int):
    """The `miles.parallel.ParallelConfig` of the flags, checked for `world_size` GPUs.

    Raises `miles.parallel.LayoutError` naming every factor and the nearest valid change, or
    `VirtualPipelineError` for virtual pipeline flags Megatron-LM would refuse.
    """
    from miles import parallel

    shape = model_shape(args)
    config = parallel.ParallelConfig(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        cp=args.context_parallel_size,
        ep=args.expert_model_parallel_size,
        etp=args.expert_tensor_parallel_size,
        sp=args.sequence_parallel,
        first_stage_layers=args.decoder_first_pipeline_num_layers,
        last_stage_layers=args.decoder_last_pipeline_num_layers,
        vpp=virtual_stages(args, shape.num_layers if shape else None),
        cp_comm_type=getattr(args, "cp_comm_type", None),
    )
    parallel.check(config, world_size, shape, where="miles.train")
    return config


def virtual_stages(args, num_layers: int | None) -> int | None:
    """Virtual pipeline stages per pipeline rank, from either Megatron-LM flag:
    --num-virtual-stages-per-pipeline-rank directly, or --num-layers-per-virtual-pipeline-stage
    (layers per pipeline rank / layers per virtual stage, even pipelines only)."""
    stages = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    per_stage = args.num_layers_per_virtual_pipeline_stage
    if per_stage is None:
        return stages
    flag = f"--num-layers-per-virtual-pipeline-stage {per_stage}"
    if stages is not None:
        raise VirtualPipelineError(
            f"{flag} and --num-virtual-stages-per-pipeline-rank {stages} both set the virtual pipeline; give one"
        )
    if (
        args.decoder_first_pipeline_num_layers is not None
        or args.decoder_last_pipeline_num_layers is not None
    ):
        raise VirtualPipelineError(
            f"{flag} with explicit first/last pipeline stage sizes: Megatron-LM needs "
            "--num-virtual-stages-per-pipeline-rank for an uneven pipeline"
        )
    pp = args.pipeline_model_parallel_size
    if pp <= 1:
        raise VirtualPipelineError(f"{flag} needs --pipeline-model-parallel-size > 1 (got {pp})")
    if num_layers is None:
        raise VirtualPipelineError(
            f"{flag}: the layer count is unknown (no --num-layers and no num_hidden_layers in "
            f"{args.hf_checkpoint}/config.json); pass --num-layers or --num-virtual-stages-per-pipeline-rank"
        )
    if num_layers % pp:
        raise VirtualPipelineError(f"{flag}: {num_layers} layers do not split evenly over pp({pp})")
    per_rank = num_layers // pp
    if per_rank % per_stage:
        raise VirtualPipelineError(
            f"{flag}: the {per_rank} layers of each pipeline rank do not split into virtual stages of {per_stage}"
        )
    return per_rank // per_stage


def model_shape(args):
    """The model facts the layout rules need: the Megatron flags first, else the HF config.

    None when neither says how deep and wide the model is (only the rank-grid rules apply).
    """
    from miles import parallel

    hf = {}
    config_path = Path(args.hf_checkpoint) / "config.json"
    if config_path.is_file():
        hf = json.loads(config_path.read_text())
    layers = args.num_layers or hf.get("num_hidden_layers")
    heads = args.num_attention_heads or hf.get("num_attention_heads")
    if not layers or not heads:
        return None
    attention = "gqa"
    variant = getattr(args, "experimental_attention_variant", None)
    if variant == "dsa" or args.dsa_indexer_topk or getattr(args, "use_dsa", False) or "index_topk" in hf:
        attention = "dsa"
    elif args.multi_latent_attention or hf.get("kv_lora_rank"):
        attention = "mla"
    return parallel.ModelShape(
        name=Path(args.hf_checkpoint).name,
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=args.num_query_groups or hf.get("num_key_value_heads"),
        num_experts=args.num_experts
        or hf.get("num_experts")
        or hf.get("num_local_experts")
        or hf.get("n_routed_experts"),
        attention=attention,
        # Megatron-LM's linear layers carry biases unless --disable-bias-linear.
        bias=not args.disable_bias_linear if args.num_layers else bool(hf.get("mlp_bias", False)),
        moe_ffn_hidden_size=args.moe_ffn_hidden_size or hf.get("moe_intermediate_size"),
    )
