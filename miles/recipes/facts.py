"""The fidelity table: every published config.json value beside the Megatron flag that carries it.

Each row is a config.json key of the model (typed in once, with its source, in
miles.recipes.specs), the flag a rule maps it to, the value the rule derives from it, and the
value the recipe's model flags (at full depth) give that flag: `ok` when they agree,
`DIFFERS` when not, `choice` when the recipe trains with another value on purpose (the spec
says why), `gap` when the key is something megatron-core cannot express (a `Gap` of the spec
says what and how the reference gets it), `UNMAPPED` when no rule and no gap covers it. A recipe is true to
its model when no row DIFFERS or is UNMAPPED; tests/unit/test_recipe_facts.py holds all five
to that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from miles.recipes.args import Args
from miles.recipes.fidelity import shown
from miles.recipes.models import ModelSpec, moe_layer_freq

ABSENT = object()  # the flag is not passed


@dataclass(frozen=True)
class Rule:
    key: str  # config.json key
    flag: str  # the Megatron flag that carries it
    derive: Callable[[object, ModelSpec], object] = lambda value, spec: value
    default: object = ABSENT  # Megatron's value when the flag is not passed
    applies: Callable[[ModelSpec], bool] = lambda spec: True
    optional: str = ""  # why the flag may be left out ("" : it may not)


def _switch(value: object, spec: ModelSpec) -> object:
    return bool(value)


def _negated(value: object, spec: ModelSpec) -> object:
    return not value


def _dense_prefix(value: object, spec: ModelSpec) -> object:
    return moe_layer_freq(int(value), spec.num_layers)


def _all_moe(value: object, spec: ModelSpec) -> object:
    # decoder_sparse_step 1 / mlp_only_layers [] : every layer is a MoE layer
    dense = bool(value) if isinstance(value, tuple | list) else value != 1
    return "(not every layer MoE)" if dense else moe_layer_freq(0, spec.num_layers)


def _gqa(spec: ModelSpec) -> bool:
    return spec.attention == "gqa"


RULES: tuple[Rule, ...] = (
    Rule("num_hidden_layers", "--num-layers"),
    Rule("hidden_size", "--hidden-size"),
    Rule("intermediate_size", "--ffn-hidden-size"),
    Rule("num_attention_heads", "--num-attention-heads"),
    Rule("swa_num_attention_heads", "--num-attention-heads"),
    Rule("num_key_value_heads", "--num-query-groups", applies=_gqa),
    # MLA expands its KV latent to one key and value per attention head.
    Rule("num_key_value_heads", "--num-attention-heads", applies=lambda spec: not _gqa(spec)),
    Rule("swa_num_key_value_heads", "--num-query-groups", applies=_gqa),
    Rule("head_dim", "--kv-channels", applies=_gqa),
    Rule("head_dim", "--v-head-dim", applies=lambda spec: not _gqa(spec)),
    Rule("rms_norm_eps", "--norm-epsilon", default=1e-5),
    Rule("rope_theta", "--rotary-base", default=10000),
    Rule("rope_scaling_factor", "--rotary-scaling-factor"),
    Rule("vocab_size", "--vocab-size"),
    Rule(
        "max_position_embeddings", "--max-position-embeddings",
        optional="not passed: rotary positions need no table, and the sequence length bounds them",
    ),
    Rule("tie_word_embeddings", "--untie-embeddings-and-output-weights", _negated, default=False),
    Rule("attention_bias", "--disable-bias-linear", _negated, default=False),
    Rule("hidden_act", "--swiglu", lambda value, spec: value == "silu", default=False),
    Rule("num_experts", "--num-experts"),
    Rule("n_routed_experts", "--num-experts"),
    Rule("num_experts_per_tok", "--moe-router-topk"),
    Rule("moe_intermediate_size", "--moe-ffn-hidden-size"),
    Rule(
        "n_shared_experts", "--moe-shared-expert-intermediate-size",
        lambda value, spec: int(value) * int(spec.published.value("moe_intermediate_size")),
    ),
    Rule("first_k_dense_replace", "--moe-layer-freq", _dense_prefix),
    Rule("dense_mlp_idx", "--moe-layer-freq", _dense_prefix),
    Rule("decoder_sparse_step", "--moe-layer-freq", _all_moe),
    Rule("mlp_only_layers", "--moe-layer-freq", _all_moe),
    Rule("norm_topk_prob", "--moe-router-pre-softmax", _negated, default=False),
    Rule("routed_scaling_factor", "--moe-router-topk-scaling-factor"),
    Rule("scoring_func", "--moe-router-score-function", default="softmax"),
    Rule("q_lora_rank", "--q-lora-rank"),
    Rule("kv_lora_rank", "--kv-lora-rank"),
    Rule("qk_nope_head_dim", "--qk-head-dim"),
    Rule("qk_rope_head_dim", "--qk-pos-emb-head-dim"),
    Rule("v_head_dim", "--v-head-dim"),
    Rule("index_n_heads", "--dsa-indexer-n-heads"),
    Rule("index_head_dim", "--dsa-indexer-head-dim"),
    Rule("index_topk", "--dsa-indexer-topk"),
    Rule("sliding_window", "--window-size", lambda value, spec: f"{value},0"),
    Rule("sliding_window_size", "--window-size", lambda value, spec: f"{value},0"),
    Rule("global_layer_period", "--window-attn-skip-freq"),
    Rule("router_aux_loss_coef", "--moe-aux-loss-coeff", default=0),
    Rule("num_nextn_predict_layers", "--mtp-num-layers", default=0),
)  # fmt: skip
RULE_KEYS = frozenset(r.key for r in RULES)


@dataclass(frozen=True)
class Row:
    key: str
    published: object
    source: str
    flag: str  # "" when no rule maps the key
    expected: str  # what the flag should be ("" when unmapped or a gap)
    recipe: str  # what the recipe passes ("(not passed)" when absent)
    status: str  # ok | choice | gap | DIFFERS | UNMAPPED
    note: str = ""  # the gap's feature, the choice's reason, or why an optional flag is left out

    @property
    def bad(self) -> bool:
        return self.status in ("DIFFERS", "UNMAPPED")


def rows(spec: ModelSpec) -> list[Row]:
    """The fidelity table of `spec` (empty without published values)."""
    if spec.published is None:
        return []
    flags = _flags(spec.model_args())
    gaps = {key: gap for gap in spec.gaps for key in gap.keys}
    choices = dict(spec.choices)
    out = []
    for key, value in spec.published.values:
        source = spec.published.source_of(key)
        gap = gaps.get(key)
        rule = next((r for r in RULES if r.key == key and r.applies(spec)), None)
        if rule is None:
            status = "gap" if gap else "UNMAPPED"
            out.append(Row(key, value, source, "", "", "", status, gap.feature if gap else ""))
            continue
        expected = shown(rule.derive(value, spec))
        passed = flags.get(rule.flag, ABSENT)
        if passed is ABSENT:
            recipe = "(not passed)" if rule.default is ABSENT else f"{shown(rule.default)} (default)"
            actual = None if rule.default is ABSENT else shown(rule.default)
        else:
            recipe = actual = shown(passed)
        if actual == expected:
            status, note = "ok", ""
        elif actual is None and rule.optional:
            status, note = "ok", rule.optional
        elif key in choices:
            status, note = "choice", choices[key]
        elif gap:
            status, note = "gap", gap.feature
        else:
            status, note = "DIFFERS", ""
        out.append(Row(key, value, source, rule.flag, expected, recipe, status, note))
    return out


def _flags(args: Args) -> dict[str, object]:
    out: dict[str, object] = {}
    for flag, value in args:
        if flag == "--moe-layer-freq":
            value = _expand(str(value))
        out[flag] = value
    return out


def _expand(pattern: str) -> str:
    """Megatron's layer pattern in one canonical spelling ("[0]*2+[1]*2" and "[0,0,1,1]" agree)."""
    layers: list[str] = []
    for part in pattern.replace(" ", "").split("+"):
        body, _, times = part.partition("*")
        layers += body.strip("[]").split(",") * (int(times) if times else 1)
    return moe_layer_freq(layers.index("1") if "1" in layers else len(layers), len(layers))


def format_table(name: str, spec: ModelSpec) -> str:
    lines = [f"{spec.name} ({name}): published config.json beside the recipe's Megatron flags (full depth)"]
    if spec.published is None:
        return lines[0] + "\n  (no published values recorded)"
    lines.append(f"  source: {spec.published.source}")
    table = rows(spec)
    width = max(len(r.key) for r in table)
    for r in table:
        value = shown(r.published) if not isinstance(r.published, tuple) else str(list(r.published))
        target = f"{r.flag} {r.expected}".strip() if r.flag else "(no Megatron flag)"
        mark = r.status if r.status != "ok" else "ok"
        tail = f"  [{r.note}]" if r.note else ""
        lines.append(f"  {r.key:<{width}}  {value:<12} -> {target:<48} recipe {r.recipe:<16} {mark}{tail}")
    own = {k for k, _ in spec.published.sources}
    for key in sorted(own):
        lines.append(f"  source of {key}: {spec.published.source_of(key)}")
    if spec.gaps:
        lines.append("  megatron-core (as pinned) cannot express:")
        lines += [f"    - {gap.feature}: {gap.why}" for gap in spec.gaps]
    return "\n".join(lines)
