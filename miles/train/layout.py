"""The Megatron parallel layout a trainer command asks for, checked by `miles.parallel`.

Standard library only: the flag parser calls it before torch is imported, so an impossible
layout fails in the first second, on any machine, with the nearest valid change named.
"""

from __future__ import annotations

import json
from pathlib import Path


def parallel_layout(args, world_size: int):
    """The `miles.parallel.ParallelConfig` of the flags, checked for `world_size` GPUs.

    Raises `miles.parallel.LayoutError` naming every factor and the nearest valid change.
    """
    from miles import parallel

    config = parallel.ParallelConfig(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        cp=args.context_parallel_size,
        ep=args.expert_model_parallel_size,
        etp=args.expert_tensor_parallel_size,
        sp=args.sequence_parallel,
        first_stage_layers=args.decoder_first_pipeline_num_layers,
        last_stage_layers=args.decoder_last_pipeline_num_layers,
    )
    parallel.check(config, world_size, model_shape(args), where="miles.train")
    return config


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
    if args.use_dsa or "index_topk" in hf:
        attention = "dsa"
    elif args.multi_latent_attention or hf.get("kv_lora_rank"):
        attention = "mla"
    return parallel.ModelShape(
        name=Path(args.hf_checkpoint).name,
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=args.num_query_groups or hf.get("num_key_value_heads"),
        num_experts=args.num_experts or hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts"),
        attention=attention,
    )
