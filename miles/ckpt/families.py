"""What each model family's checkpoint looks like, as the checkpoint steps read it.

The transformers classes themselves are the source of truth for tensor names and shapes
(validate builds the model on the meta device). What transformers cannot say (which model
types a family accepts, how small a tiny model is, how a checkpoint names its MTP layers)
is the family's (`miles.families`), as is whether megatron-core builds the family (its
torch_dist then holds megatron's keys).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from miles import families
from miles.ckpt.errors import CheckpointError
from miles.families import Family
from miles.families.facts import text_config

__all__ = [
    "LAYER_LIST_KEYS", "LAYER_RE", "Family", "expected_architectures", "family", "layers_in_name", "mtp_layer_prefix", "mtp_layers", "mtp_prefixes",
    "num_layers", "text_config", "writes_megatron_keys",
]  # fmt: skip

# Decoder layers: model.layers.N.*, or model.language_model.layers.N.* / model.llm.layers.N.* in
# multimodal checkpoints (the latter is Inkling's published naming).
LAYER_RE = re.compile(
    r"^(?P<prefix>(?:model\.)?(?:language_model\.|llm\.)?layers)\.(?P<index>\d+)\.(?P<rest>.+)$"
)
# Per-layer lists in config.json that must keep one entry per layer when a checkpoint is cut.
LAYER_LIST_KEYS = ("layer_types", "mlp_layer_types", "indexer_types")
_NAME_LAYERS_RE = re.compile(r"-(\d+)[-_]?layers?\b", re.IGNORECASE)


def family(name: str) -> Family:
    try:
        return families.family(name)
    except families.UnknownFamily as exc:
        raise CheckpointError(str(exc)) from None


def writes_megatron_keys(name: str) -> bool:
    """Whether a family's torch_dist is written in megatron-core GPTModel's keys (else HF names kept)."""
    return family(name).megatron


def num_layers(config: Mapping[str, Any]) -> int | None:
    value = text_config(config).get("num_hidden_layers")
    return value if isinstance(value, int) else None


def mtp_layers(config: Mapping[str, Any]) -> int:
    """How many MTP layers the config declares (they follow the decoder layers in the checkpoint)."""
    text = text_config(config)
    value = text.get(
        "num_nextn_predict_layers", text.get("num_mtp_layers", text.get("mtp_num_hidden_layers"))
    )
    return value if isinstance(value, int) else 0


# Where each MTP style (miles.families.family's mtp_style) keeps MTP layer k's decoder layer; L is
# the decoder's depth
_MTP_LAYER_PREFIX = {
    "layers": "model.layers.{L_plus_k}.", "mtp": "mtp.{k}.", "mtp_layers": "mtp.layers.{k}.",
    "mimo": "model.mtp_layers.{k}.",
}  # fmt: skip


def mtp_layer_prefix(style: str, layers: int, k: int) -> str:
    """The checkpoint prefix of MTP layer `k`'s decoder layer in a family of MTP style `style`
    whose decoder has `layers` layers."""
    try:
        return _MTP_LAYER_PREFIX[style].format(k=k, L_plus_k=layers + k)
    except KeyError:
        raise ValueError(f"MTP style {style!r}: known styles are {', '.join(_MTP_LAYER_PREFIX)}") from None


def mtp_prefixes(config: Mapping[str, Any], style: str | None) -> list[str]:
    """Checkpoint name prefixes of the MTP block a family of MTP style `style` keeps (every tensor of
    it starts with one; miles.families.family's mtp_style)."""
    count = mtp_layers(config)
    if not count or style not in _MTP_LAYER_PREFIX:
        return []
    if style == "mtp_layers":
        return ["mtp."]  # the layers and the block's own mtp.fc and norms
    layers = int(text_config(config)["num_hidden_layers"])
    return [mtp_layer_prefix(style, layers, k) for k in range(count)]


def layers_in_name(model_name: str) -> int | None:
    """N of a "-Nlayer" model name (e.g. Inkling-Small-4layer -> 4), else None."""
    m = _NAME_LAYERS_RE.search(model_name)
    return int(m.group(1)) if m else None


def expected_architectures(model_type: str) -> tuple[str, ...]:
    """The class names transformers registers for a model type (causal LM or multimodal)."""
    from transformers.models.auto import modeling_auto

    names = []
    for mapping in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"):
        value = getattr(modeling_auto, mapping, {}).get(model_type)
        if value:
            names.extend([value] if isinstance(value, str) else value)
    return tuple(dict.fromkeys(names))
