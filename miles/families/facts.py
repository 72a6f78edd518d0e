"""How a config.json key becomes a Megatron flag: the rows of a family's facts table.

A `Key` row names a config.json key, the Megatron-LM flag that carries it, how the flag's
value follows from the key's (and the rest of the config), Megatron's value when the flag is
not passed, and whether a different value describes a different model (the backend refuses
it) or may be a training choice; a `Fixed` row is a flag the architecture fixes. A family
(miles.families.family) holds one table of them. Everything that reads config.json against
Megatron flags (the recipes' fact check, the Megatron backend's model-flag check, the layout
checker's model shape, the converter) reads these rows. Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ABSENT = object()  # a key the config lacks, or a flag that is not passed
ATTENTION_KINDS = ("gqa", "mla", "dsa")


def as_is(value: object, config: Mapping[str, Any]) -> object:
    return value


def negated(value: object, config: Mapping[str, Any]) -> object:
    return not value


def is_silu(value: object, config: Mapping[str, Any]) -> object:
    return value == "silu"


def window(value: object, config: Mapping[str, Any]) -> object:
    """Megatron-LM's --window-size LEFT,RIGHT for a Hugging Face sliding window of `value`.

    transformers admits key k for query q when q - value < k <= q (masking_utils,
    sliding_window_overlay): `value` keys, the query's own among them. megatron-core's (LEFT,
    RIGHT) admits q - LEFT <= k <= q + RIGHT (transformer/utils.py,
    get_sliding_window_causal_mask; Transformer Engine's window_size alike): LEFT + 1 keys. So
    a window of `value` keys is (value - 1, 0)."""
    return f"{int(value) - 1},0"


def moe_layer_freq(first_k_dense: int, num_layers: int) -> str:
    """Megatron's per-layer MoE pattern: the leading dense layers (capped at the depth), then MoE."""
    dense = min(first_k_dense, num_layers)
    parts = [f"[0]*{dense}"] if dense else []
    if num_layers - dense:
        parts.append(f"[1]*{num_layers - dense}")
    return "+".join(parts)


def dense_prefix(value: object, config: Mapping[str, Any]) -> object:
    return moe_layer_freq(int(value), int(config["num_hidden_layers"]))


def all_moe(value: object, config: Mapping[str, Any]) -> object:
    # decoder_sparse_step 1 / mlp_only_layers [] : every layer is a MoE layer
    dense = bool(value) if isinstance(value, tuple | list) else value != 1
    return "(not every layer MoE)" if dense else moe_layer_freq(0, int(config["num_hidden_layers"]))


def shared_experts(value: object, config: Mapping[str, Any]) -> object:
    return int(value) * int(config["moe_intermediate_size"])


def layer_pattern(pattern: str) -> str:
    """Megatron's layer pattern in one canonical spelling ("[0]*2+[1]*2" and "[0,0,1,1]" agree)."""
    layers: list[str] = []
    for part in str(pattern).replace(" ", "").split("+"):
        body, _, times = part.partition("*")
        layers += body.strip("[]").split(",") * (int(times) if times else 1)
    return moe_layer_freq(layers.index("1") if "1" in layers else len(layers), len(layers))


@dataclass(frozen=True)
class Key:
    key: str  # config.json key
    flag: str  # the Megatron-LM flag that carries it
    derive: Callable[[object, Mapping[str, Any]], object] = as_is  # (key's value, whole config) -> flag value
    default: object = ABSENT  # Megatron's value when the flag is not passed
    optional: str = ""  # why the flag may be left out ("": it may not)
    # whether another value describes another model (the Megatron backend refuses a flag that
    # disagrees with config.json); False for what a recipe may train with on purpose
    describes_model: bool = True
    # the key's value when config.json leaves it out, from the rest of the config (None: none)
    fallback: Callable[[Mapping[str, Any]], object] | None = None

    def read(self, config: Mapping[str, Any]) -> object:
        """The key's value in `config` (ABSENT when it says nothing)."""
        found = value(config, self.key)
        if found is ABSENT and self.fallback is not None:
            found = self.fallback(config)
        return found


@dataclass(frozen=True)
class Fixed:
    """A Megatron flag whose value the architecture fixes (no config.json key carries it): another
    value describes another model, and the backend refuses it."""

    flag: str
    value: object
    why: str  # what in the model fixes it


# Rows every family shares.
COMMON: tuple[Key, ...] = (
    Key("num_hidden_layers", "--num-layers"),
    Key("hidden_size", "--hidden-size"),
    Key("intermediate_size", "--ffn-hidden-size"),
    Key("num_attention_heads", "--num-attention-heads"),
    Key("rms_norm_eps", "--norm-epsilon", default=1e-5),
    Key("rope_theta", "--rotary-base", default=10000),
    Key("vocab_size", "--vocab-size"),
    Key(
        "max_position_embeddings", "--max-position-embeddings",
        optional="not passed: rotary positions need no table, and the sequence length bounds them",
        describes_model=False,
    ),
    Key("tie_word_embeddings", "--untie-embeddings-and-output-weights", negated, default=False),
    Key("attention_bias", "--disable-bias-linear", negated, default=False),
    Key("hidden_act", "--swiglu", is_silu, default=False),
)  # fmt: skip


def _heads_split_hidden(config: Mapping[str, Any]) -> object:
    if config.get("hidden_size") and config.get("num_attention_heads"):
        return config["hidden_size"] // config["num_attention_heads"]
    return ABSENT


# Grouped-query attention: one query group per KV head; transformers' default head_dim is
# hidden_size / num_attention_heads.
GQA: tuple[Key, ...] = (
    Key("num_key_value_heads", "--num-query-groups"),
    Key("head_dim", "--kv-channels", fallback=_heads_split_hidden),
)
# Multi-latent attention expands its KV latent to one key and value per attention head.
MLA: tuple[Key, ...] = (
    Key("num_key_value_heads", "--num-attention-heads", describes_model=False),
    Key("head_dim", "--v-head-dim"),
)
MOE: tuple[Key, ...] = (
    Key("num_experts_per_tok", "--moe-router-topk"),
    Key("moe_intermediate_size", "--moe-ffn-hidden-size"),
    Key("router_aux_loss_coef", "--moe-aux-loss-coeff", default=0, describes_model=False),
)
ROUTED_EXPERTS: tuple[Key, ...] = (  # DeepSeek-style routed and shared experts
    Key("n_routed_experts", "--num-experts"),
    Key("n_shared_experts", "--moe-shared-expert-intermediate-size", shared_experts),
)
MTP: tuple[Key, ...] = (Key("num_nextn_predict_layers", "--mtp-num-layers", default=0),)


# --- reading a config.json -----------------------------------------------------------------


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decoder's part of a config (multimodal configs nest it under text_config)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def rope_parameters(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """transformers 5 writes rope_parameters; older configs write rope_theta / rope_scaling."""
    rope = dict(config.get("rope_scaling") or {})
    rope.update(config.get("rope_parameters") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope["type"]
    return rope


def indexer_types(config: Mapping[str, Any], count: int | None = None) -> tuple[str, ...]:
    """ "full" or "shared" for each of `count` layers (default: the decoder's) of a DSA model with
    cross-layer top-k sharing: a shared layer reuses the top-k of the nearest full layer below.

    transformers' GlmMoeDsaConfig takes config.json's `indexer_types` as written, else
    `index_topk_pattern` ("F"/"S" per layer), else layer i is full when
    max(i - index_skip_topk_offset + 1, 0) is a multiple of index_topk_freq (defaults 2 and 1:
    every layer full). Layers past the list (MTP layers) follow the formula.
    """
    count = int(config["num_hidden_layers"]) if count is None else count
    written = list(config.get("indexer_types") or [])
    pattern = config.get("index_topk_pattern")
    if isinstance(pattern, str):
        written = [{"F": "full", "S": "shared"}[c] for c in pattern]
    elif pattern is not None:
        written = list(pattern)
    freq = max(int(config.get("index_topk_freq") or 1), 1)
    offset = config.get("index_skip_topk_offset")
    offset = 2 if offset is None else int(offset)
    return tuple(
        written[i] if i < len(written) else "full" if max(i - offset + 1, 0) % freq == 0 else "shared"
        for i in range(count)
    )


def source_layers(kinds: Sequence[str]) -> tuple[int, ...]:
    """For each layer (0-based) of `kinds` ("full"/"shared", `indexer_types`), the layer whose DSA
    top-k it uses: itself when full, else the nearest full layer below."""
    out, last = [], None
    for i, kind in enumerate(kinds):
        if kind == "full":
            last = i
        elif last is None:
            raise ValueError(
                f"layer {i} is a shared DSA layer with no full layer below it to take the top-k from"
            )
        out.append(i if kind == "full" else last)
    return tuple(out)


def shared_index_layers(config: Mapping[str, Any], count: int | None = None) -> tuple[int, ...]:
    """The (0-based) layers that reuse another layer's DSA top-k instead of running an indexer."""
    if not any(k in config for k in ("indexer_types", "index_topk_pattern", "index_topk_freq")):
        return ()
    return tuple(i for i, kind in enumerate(indexer_types(config, count)) if kind == "shared")


def value(config: Mapping[str, Any], key: str) -> object:
    """A key's value in a config.json, wherever transformers writes it (ABSENT when it says nothing)."""
    if key == "rope_theta":
        if "rope_theta" in config or "rope_parameters" in config or "rope_scaling" in config:
            return rope_parameters(config)["rope_theta"]
        return ABSENT
    if key == "rope_scaling_factor" and key not in config:
        return rope_parameters(config).get("factor", ABSENT)
    if key == "num_experts" and config.get("num_experts") is None:
        # Hub configs say num_experts; transformers 5 writes num_local_experts.
        return config.get("num_local_experts", ABSENT) or ABSENT
    found = config.get(key, ABSENT)
    return ABSENT if found is None else found


def flag_values(keys: Iterable[Key], config: Mapping[str, Any]) -> dict[str, object]:
    """The Megatron flags a config.json implies, each from the first row that carries it."""
    out: dict[str, object] = {}
    for row in keys:
        found = row.read(config)
        if found is not ABSENT and row.flag not in out:
            out[row.flag] = row.derive(found, config)
    return out


def flag_value(keys: Iterable[Key], config: Mapping[str, Any], flag: str) -> object:
    return flag_values(keys, config).get(flag, ABSENT)


# --- comparing ----------------------------------------------------------------------------


def shown(value: object) -> str:
    """A flag value as comparisons print it; numbers compare by value (1e-06 == 0.000001)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple | list):
        return ",".join(shown(v) for v in value)
    if isinstance(value, int | float):
        number = float(value)
        return str(int(number)) if number.is_integer() else repr(number)
    try:
        number = float(str(value))
    except ValueError:
        return str(value)
    return str(int(number)) if number.is_integer() else repr(number)


def same(flag: str, a: object, b: object) -> bool:
    """Whether two values of `flag` say the same thing."""
    if flag == "--moe-layer-freq":
        return layer_pattern(str(a)) == layer_pattern(str(b))
    return shown(a) == shown(b)


def disagreements(
    keys: Iterable[Key], config: Mapping[str, Any], given: Mapping[str, object], fixed: Iterable[Fixed] = ()
) -> list[str]:
    """'<flag> <given> (config.json <key>: <value>)' for each flag in `given` that describes
    another model than the config.json does (or than the architecture fixes: `fixed`)."""
    out = [
        f"{row.flag} {shown(given[row.flag])} ({row.why}: {shown(row.value)})"
        for row in fixed
        if row.flag in given and not same(row.flag, given[row.flag], row.value)
    ]
    for row in keys:
        if not row.describes_model or row.flag not in given:
            continue
        found = row.read(config)
        if found is ABSENT:
            continue
        want = row.derive(found, config)
        if not same(row.flag, given[row.flag], want):
            out.append(f"{row.flag} {shown(given[row.flag])} (config.json {row.key}: {shown(found)})")
    return out
