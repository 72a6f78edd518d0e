"""What a model family is: its facts, how megatron-core builds it, its weights and its limits.

A family is one folder of `miles/families/`, named by its config.json model_type, whose
`__init__.py` defines `FAMILY`: an instance of a subclass of one of the two kinds here.
`GPTFamily` is built by megatron-core's GPTModel (its decoder layers' weights, and optionally
its own layer spec and what it adds to a built chunk); `OwnModelFamily` builds model chunks of
its own (DeepSeek-V4: hash routing reads token ids, hyper-connections carry several streams).
Both take the defaults of `Family` for everything they do not say.

The facts (class attributes) are standard library only: recipes, the layout checker and the
checkpoint steps read them without torch. What builds a model imports torch and megatron-core
inside the method that needs it; a family's own megatron-core modules live in its folder.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from miles.families.facts import ATTENTION_KINDS, Fixed, Key, text_config
from miles.families.schema import COMMON_SCHEMA, ConfigRefused, Rule, check_config
from miles.families.weights import OUTER_NAMES, Weights, whole
from miles.parallel import FamilyLimits

_EMPTY: Mapping[str, Any] = MappingProxyType({})


class UnmappedModel(ValueError):
    """A config megatron-core cannot build for its family (the message names the key and the fix)."""


class Family:
    """One model family. Subclasses set the facts and override what differs from the defaults."""

    # --- facts: what config.json says and which Megatron flags carry it ---------------------------
    name: ClassVar[str]  # the folder's name: the family's (first) model_type
    model_types: ClassVar[tuple[str, ...]]  # config.json model_type values it accepts
    attention: ClassVar[str]  # gqa | mla | dsa
    keys: ClassVar[tuple[Key, ...]]  # config.json keys <-> Megatron flags
    # Megatron flags the architecture fixes (checked like the rows: another value is another model)
    fixed: ClassVar[tuple[Fixed, ...]] = ()
    # config.json keys the Megatron model reads itself, with no flag (key: what reads it)
    read_by_model: ClassVar[Mapping[str, str]] = _EMPTY
    # each config.json key's type and range and the rules between keys (miles.families.schema),
    # checked before any arithmetic on the config or any model built from it
    schema: ClassVar[tuple[Rule, ...]] = COMMON_SCHEMA
    # integer lookup tables among the weights whose entries are ids: (tensor name suffix, the
    # config.json key counting the ids, the integer dtypes the model's loaders hold); each entry is
    # in [0, count) and no row names an id twice
    id_tables: ClassVar[tuple[tuple[str, str, tuple[str, ...]], ...]] = ()
    # other names config.json may give a key the schema names (name in config.json: schema's name)
    schema_aliases: ClassVar[Mapping[str, str]] = _EMPTY

    # --- the tiny checkpoint the CPU lane trains ----------------------------------------------------
    tiny_model_type: ClassVar[str]  # the causal-LM config make_tiny_checkpoint builds
    # the transformers class a tiny checkpoint is saved from, where the release's is not the causal LM
    # (a vision-language release: its tensor names and its vision tower); None: AutoModelForCausalLM
    tiny_class: ClassVar[str | None] = None
    # A tiny model is small in sizes only: every switch the published model sets keeps its value.
    tiny_dims: ClassVar[Mapping[str, Any]] = _EMPTY
    tiny_layers: ClassVar[int] = 2  # enough decoder layers for every kind of layer the model has
    sdpa: ClassVar[bool] = True  # transformers' class supports attn_implementation="sdpa"
    # transformers' model type whose causal LM loads the checkpoint's trunk, where transformers has no
    # class of the release's own (config.json's model_type then names remote code, which miles never
    # runs; `trunk_config` is config.json as that class reads it); None: the release's own class
    trunk_model_type: ClassVar[str | None] = None
    # the class names a release's config.json declares where transformers registers none for its model type
    release_architectures: ClassVar[tuple[str, ...]] = ()
    # How the checkpoint names MTP layers: "layers" = model.layers.{L+k}.* with eh_proj/enorm/hnorm
    # (DeepSeek-V3 style, GLM-5); "mtp" = mtp.{k}.* with e_proj/h_proj (DeepSeek-V4); "mtp_layers" =
    # mtp.layers.{k}.* with mtp.fc and mtp.pre_fc_norm_* (Qwen3.5); "mimo" = model.mtp_layers.{k}.*
    # with input_proj ([hidden; token]), token_layernorm, hidden_layernorm, final_layernorm and the
    # decoder layer's own tensors (MiMo); None = none.
    mtp_style: ClassVar[str | None] = None
    # Whether an MTP layer zeroes the embedding it reads at position 0 (MiMo's forward in SGLang)
    mtp_masks_first_position: ClassVar[bool] = False
    # The kind an MTP layer has in each per-layer list of config.json (layer_types: its attention),
    # where the published model fixes it; a list not named here is re-derived for the deeper model.
    mtp_layer_kinds: ClassVar[Mapping[str, str]] = _EMPTY
    # Linear modules (by their last name) the family's FP8 checkpoints keep in bf16, beyond the
    # shared rules (norms, embeddings, routers, heads): miles.ckpt.fp8_rules.
    fp8_keep: ClassVar[frozenset[str]] = frozenset()

    # --- megatron-core ------------------------------------------------------------------------------
    megatron: ClassVar[bool] = True  # whether megatron-core builds it here (else the FSDP fallback)
    config_class: ClassVar[str] = "TransformerConfig"  # megatron.core.transformer's class the fields fill
    position_embedding_type: ClassVar[str] = "rope"  # GPTModel's ("none": the layers place tokens)
    # Checkpoint tensors outside the decoder that megatron's model leaves out, by name prefix:
    # ((prefix, what they are), ...); the conversion names them in its report
    not_decoder: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Tokens the conversion's logit check runs through: long enough to reach every attention path
    probe_length: ClassVar[int] = 24
    # transformers' router classes that pick each token's experts with one top-k over their scores
    # (miles.train.routing_replay records and replays that pick); none for a dense model
    router_classes: ClassVar[tuple[str, ...]] = ()
    # Whether transformers' class renames the checkpoint's tensors on load (then `model_name` gives
    # the class's names, which the built-in rollout engine loads)
    renames_on_load: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"<family {self.name}>"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        attention = cls.__dict__.get("attention")
        if attention is not None and attention not in ATTENTION_KINDS:
            raise ValueError(
                f"{cls.__name__}: attention {attention!r} is not one of {', '.join(ATTENTION_KINDS)}"
            )

    def key(self, name: str) -> Key | None:
        return next((k for k in self.keys if k.key == name), None)

    # --- reading a config.json ---------------------------------------------------------------------

    def check_config(self, config: Mapping[str, Any]) -> None:
        """Raise miles.families.schema.ConfigRefused ('<key> = <value>: <rule>; <fix>') for the
        first rule of the family's schema that config.json (as written) breaks."""
        if not isinstance(config, Mapping):
            raise ConfigRefused(
                "config.json", config, "must be a JSON object", "write the model's config.json"
            )
        check_config(self.schema, self.schema_view(config))

    def schema_view(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """The keys `schema` names, read from config.json as written: the decoder's part, nothing
        derived, a key written under another name (`schema_aliases`) under the schema's name."""
        out = dict(text_config(config))
        for alias, name in self.schema_aliases.items():
            if out.get(name) is None and alias in out:
                out[name] = out[alias]
        return out

    def decoder_config(self, config: Mapping[str, Any]) -> dict:
        """config.json as the rest reads it: the decoder's own config, normalised as transformers
        normalises it (a multimodal release nests it under text_config with keys of its own)."""
        return dict(text_config(config))

    def limits(self, config: Mapping[str, Any]) -> FamilyLimits:
        """What the family's model supports of a parallel layout beyond megatron-core's own rules,
        checked by miles.parallel before anything starts and by the build in the same words."""
        return FamilyLimits()

    def left_padding_exact(self, config: Mapping[str, Any]) -> bool:
        """Whether transformers' model gives a left-padded row the logits it gives the row alone
        (the built-in rollout engine batches prompts of distinct lengths only where it does)."""
        return True

    def tiny_values(self, model: Any, gen: Any) -> None:
        """Values for what transformers initialises to a constant (norms at 1, biases at 0, lookup
        tables at 0) that would hide code paths in a tiny model, set on the freshly built model
        before it is saved (torch.Generator `gen`)."""

    def tiny_config(self, values: Mapping[str, Any]) -> dict:
        """AutoConfig.for_model's arguments for a tiny checkpoint whose decoder has `values` (a
        multimodal release nests them under text_config)."""
        return dict(values)

    def trunk_config(self, config: Mapping[str, Any]) -> dict:
        """config.json as the transformers class that loads the checkpoint reads it (see
        trunk_model_type): the release's own."""
        return dict(config)

    def release_config(self, config: Mapping[str, Any]) -> dict:
        """A tiny checkpoint's config.json as the published checkpoints write it, from the one its
        transformers class saved (where that class is not the release's: `trunk_model_type`)."""
        return dict(config)

    def tiny_mtp_values(self, tensors: dict, gen: Any) -> None:
        """Values for the tiny checkpoint's MTP tensors (name: tensor, replaced in place) beyond the
        random ones miles.ckpt.tiny draws (norms at 1, biases at 0 unless the family moves them)."""

    def mtp_extras(self, prefix: str, config: Mapping[str, Any], hidden: int) -> Iterator[tuple]:
        """A tiny checkpoint's MTP block beyond its decoder layer, under `prefix`, as its published
        checkpoints name it: (name, shape, dtype) for each tensor, the dtype "model" (the weights'),
        "norm" (the norms') or a part of another tensor's name to take the dtype of (miles.ckpt.tiny
        makes the values)."""
        return iter(())

    # --- megatron-core ----------------------------------------------------------------------------

    def refuse_unmapped(self, config: Mapping[str, Any]) -> None:
        """Raise UnmappedModel naming a config value megatron-core's model cannot compute."""

    def transformer_fields(self, config: Mapping[str, Any]) -> dict:
        """The TransformerConfig fields of the model: its facts table's, and what the family adds."""
        from miles.families.transformer import model_fields

        return model_fields(self.keys, config)

    def lm_args(self, config: Mapping[str, Any]) -> dict:
        """Megatron-LM arguments common.pt records beyond the shared ones."""
        return {}

    def weights(self, config: Mapping[str, Any]) -> Weights:
        """(megatron name, where its rows come from) for every weight of the whole model."""
        raise NotImplementedError(f"{self.name}: no weight layout")

    def source_name(self, name: str, present: Collection[str]) -> str:
        """The name a checkpoint holding `present` tensors gives one of `weights`' names."""
        return name

    def source_piece(self, piece, present: Collection[str]):
        """A piece of `weights` as a checkpoint holding `present` tensors stores it (by default: under
        `source_name`; a family whose releases stack what transformers saves apart says where)."""
        from dataclasses import replace

        return replace(piece, hf_name=self.source_name(piece.hf_name, present))

    def model_name(self, name: str) -> str:
        """transformers' class's name of one of `weights`' checkpoint names (see renames_on_load)."""
        return name

    def outer_names(self, config: Mapping[str, Any]) -> tuple[str, str, str]:
        """The checkpoint's names of the word embedding, the final norm and the output layer."""
        return OUTER_NAMES

    def pipeline_rows(self, config: Mapping[str, Any]) -> int:
        """How many rows a pipeline stage sends the next per sequence row (several residual
        streams cross as [s, rows x streams, d]; megatron-core sizes p2p buffers from it)."""
        return 1

    def build_model(self, tc, config: Mapping[str, Any], vocab_size: int, vp_stage: int | None, *, impl: str):
        """This rank's model chunk, in the parameter dtype."""
        raise NotImplementedError(f"{self.name}: no model builder")


class GPTFamily(Family):
    """A family megatron-core's GPTModel builds: the decoder layers' weights are the family's, the
    model around them is GPT's (embedding, final norm, output layer)."""

    def layer_weights(self, config: Mapping[str, Any], i: int, mg: str) -> Weights:
        """The weights of decoder layer `i` of the HF model, under megatron layer prefix `mg`."""
        raise NotImplementedError(f"{self.name}: no layer weights")

    def embedding_weights(self, config: Mapping[str, Any]) -> Weights:
        """The first stage's weights beyond the word embedding (an embedding norm)."""
        return iter(())

    def extra_weights(self, config: Mapping[str, Any]) -> Weights:
        """The weights outside the decoder layers the family adds (carried MTP layers)."""
        return iter(())

    def weights(self, config: Mapping[str, Any]) -> Weights:
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        embed, norm, head = self.outer_names(config)
        yield "embedding.word_embeddings.weight", (whole(embed, vocab),)
        yield from self.embedding_weights(config)
        for i in range(config["num_hidden_layers"]):
            yield from self.layer_weights(config, i, f"decoder.layers.{i}.")
        yield "decoder.final_layernorm.weight", (whole(norm, hidden),)
        if not config.get("tie_word_embeddings"):
            yield "output_layer.weight", (whole(head, vocab),)
        yield from self.extra_weights(config)

    def block_spec(self, tc, config: Mapping[str, Any], vp_stage: int | None = None, *, impl: str = "local"):
        """This chunk's decoder block spec: megatron-core's Transformer Engine GPT spec (TE's own
        modules with `impl` "transformer_engine", the TE-shaped local ones otherwise)."""
        from miles.megatron.spec import decoder_block_spec

        return decoder_block_spec(tc, impl=impl, vp_stage=vp_stage)

    def rotary_percent(self, config: Mapping[str, Any]) -> float:
        """The share of each head's dimensions rope rotates (GPTModel's rotary_percent)."""
        return 1.0

    def finish_model(
        self, model, tc, config: Mapping[str, Any], vp_stage: int | None = None, *, impl: str = "local"
    ):
        """What the family adds to a built chunk, already in the parameter dtype (carried MTP
        layers, float32 parameters), or refuses (a chunk that cannot run alone)."""

    def build_model(
        self,
        tc,
        config: Mapping[str, Any],
        vocab_size: int,
        vp_stage: int | None = None,
        *,
        impl: str = "local",
    ):
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel

        from miles.families.facts import rope_parameters

        rope = rope_parameters(config)
        interpolation = float(rope["factor"]) if rope.get("rope_type") == "linear" else None
        placed = parallel_state.model_parallel_is_initialized()
        first = (
            parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            if placed
            else True
        )
        last = (
            parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage) if placed else True
        )
        model = GPTModel(
            config=tc,
            transformer_layer_spec=self.block_spec(tc, config, vp_stage, impl=impl),
            vocab_size=vocab_size,
            max_sequence_length=config.get("max_position_embeddings", 4096),
            pre_process=first,
            post_process=last,
            position_embedding_type=self.position_embedding_type,
            rotary_base=rope["rope_theta"],
            rotary_percent=self.rotary_percent(config),
            seq_len_interpolation_factor=interpolation,
            share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings")),
            vp_stage=vp_stage,
        )
        model = model.to(tc.params_dtype)
        self.finish_model(model, tc, config, vp_stage, impl=impl)
        return model


class OwnModelFamily(Family):
    """A family whose model chunks are its own modules (not a GPTModel); it lays out its whole
    model's weights itself (`weights`) and builds its chunks (`build_model`)."""
