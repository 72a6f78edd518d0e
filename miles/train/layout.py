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
    """The model facts the layout rules need: the Megatron flags first, else what config.json
    implies through its family's facts table (`miles.families`).

    None when neither says how deep and wide the model is (only the rank-grid rules apply).
    """
    from miles import families, parallel
    from miles.families.facts import flag_values, shared_index_layers, text_config
    from miles.parallel.layout import dest

    hf = {}
    config_path = Path(args.hf_checkpoint) / "config.json"
    if config_path.is_file():
        from miles.families import decoder_config

        hf = text_config(decoder_config(json.loads(config_path.read_text())))
    implied = flag_values(families.keys_of(hf), hf)
    family = families.family_of(hf)

    def flag(name: str):
        given = getattr(args, dest(name), None)
        return given if given not in (None, False) else implied.get(name)

    layers, heads = flag("--num-layers"), flag("--num-attention-heads")
    if not layers or not heads:
        return None
    return parallel.ModelShape(
        name=Path(args.hf_checkpoint).name,
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=flag("--num-query-groups"),
        num_experts=flag("--num-experts"),
        attention=_attention(args, hf, implied),
        # Megatron-LM's linear layers carry biases unless --disable-bias-linear; a config.json
        # without attention_bias has none
        bias=not args.disable_bias_linear
        if args.num_layers
        else not implied.get("--disable-bias-linear", True),
        moe_ffn_hidden_size=flag("--moe-ffn-hidden-size"),
        shared_index_layers=shared_index_layers(hf, layers) if hf else (),
        # what the family's own modules support: its build refuses the rest in the same words
        limits=family.limits(hf) if family is not None else parallel.FamilyLimits(),
        vocab_size=flag("--vocab-size"),
    )


def _attention(args, hf: dict, implied: dict) -> str:
    """gqa | mla | dsa: the command's attention flags, else the config's family, else its keys."""
    from miles import families

    variant = getattr(args, "experimental_attention_variant", None)
    if variant == "dsa" or args.dsa_indexer_topk or getattr(args, "use_dsa", False):
        return "dsa"
    if args.multi_latent_attention:
        return "mla"
    family = families.family_of(hf)
    if family is not None:
        return family.attention
    if "--dsa-indexer-topk" in implied:
        return "dsa"
    return "mla" if "--kv-lora-rank" in implied else "gqa"
