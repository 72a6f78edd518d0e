"""The Megatron parallel layout a trainer command asks for, checked by `miles.parallel`.

Standard library only: the flag parser calls it before torch is imported, so an impossible
layout fails in the first second, on any machine, with the nearest valid change named.
"""

from __future__ import annotations

import json
from pathlib import Path


def parallel_layout(args, world_size: int):
    """The `miles.parallel.ParallelLayout` of the flags, checked for `world_size` GPUs.

    Raises `miles.parallel.InvalidParallelism` naming every factor and the nearest valid change,
    or `miles.parallel.VirtualPipelineError` for virtual pipeline flags Megatron-LM would refuse.
    """
    from miles import parallel

    shape = model_shape(args)
    layout = parallel.ParallelLayout.from_args(args, shape.num_layers if shape else None)
    parallel.check(layout, world_size, shape, where="miles.train")
    return layout


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
