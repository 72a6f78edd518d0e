"""Tiny random checkpoints of the recipes' real architectures, built locally without network.

The model is the family's own transformers class (AutoModelForCausalLM.from_config) with
random weights from a seed, saved sharded with an index like a hub checkpoint. The
tokenizer is byte-level with one token per byte, so every digit, letter and symbol of a
synthetic task is a single token and nothing is ever unknown; it carries a ChatML chat
template. Same arguments, same bytes: the CPU lane's runs are reproducible.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from miles import phases
from miles.ckpt.errors import CheckpointError
from miles.ckpt.families import LAYER_LIST_KEYS, LAYER_RE, mtp_layer_prefix, mtp_layers, text_config
from miles.ckpt.families import family as get_family
from miles.ckpt.manifest import HF_STEPS, TINY_STEP, atomic_dir, finished, read_manifest, write_manifest
from miles.families.schema import ConfigRefused

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0, 1, 2
DEFAULT_SHARD_BYTES = 1_000_000  # small enough that every tiny checkpoint has several shards
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_params(family: str, layers: int, seed: int, dtype: str, shard_bytes: int, dims: Mapping[str, Any]):
    """What a tiny checkpoint is a function of; its manifest records exactly this.

    `dims` is recorded merged over the family's defaults, so new defaults rebuild old tiny models.
    """
    return {
        "family": family,
        "layers": layers,
        "seed": seed,
        "dtype": dtype,
        "shard_bytes": shard_bytes,
        "dims": {**get_family(family).tiny_dims, **dims},
    }


def make_tiny_checkpoint(
    family: str,
    layers: int,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
    **dims: Any,
) -> Path:
    """Build (or find already built) a random `layers`-deep checkpoint of `family` in `out_dir`.

    `dims` override any key of the family's tiny config (hidden_size=2048, vocab_size=32768,
    tie_word_embeddings=0, num_nextn_predict_layers=0, ...), which is how the benchmarks make
    multi-GB checkpoints with the same code; 0/1 stand for false/true where the config wants a bool.
    progress=False silences transformers' own progress bars while the shards are written.
    """
    spec = get_family(family)
    if layers < 1:
        raise CheckpointError(f"make_tiny_checkpoint: layers must be >= 1, got {layers}")
    out = Path(out_dir)
    params = tiny_params(family, layers, seed, dtype, shard_bytes, dims)
    if finished(out, TINY_STEP, f"tiny:{family}", params) and not _damaged(out):
        return out
    with (
        phases.phase(phases.CHECKPOINT),
        atomic_dir(out, reads=(), replaces=HF_STEPS) as tmp,
        _transformers_progress(progress),
    ):
        _save_model(spec, layers, seed, dtype, shard_bytes, dims, tmp)
        build_tokenizer(
            int(dims.get("max_position_embeddings", spec.tiny_dims["max_position_embeddings"]))
        ).save_pretrained(tmp)
        write_manifest(tmp, TINY_STEP, f"tiny:{family}", params)
    return out


def _damaged(out: Path) -> bool:
    """A finished checkpoint whose files are no longer the ones written (it is built again)."""
    from miles.ckpt.verify import file_problems

    manifest = read_manifest(out)
    return manifest is None or bool(file_problems(out, manifest))


@contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    if enabled:
        yield
        return
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _save_model(spec, layers: int, seed: int, dtype: str, shard_bytes: int, dims, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = {
        name: SPECIAL_TOKENS.index(tok)
        for name, tok in (("pad", PAD_TOKEN), ("bos", PAD_TOKEN), ("eos", EOS_TOKEN))
    }
    kwargs = _typed(spec.tiny_model_type, {"tie_word_embeddings": False, **spec.tiny_dims, **dims})
    fixed = {"num_hidden_layers": layers, "pad_token_id": ids["pad"], "bos_token_id": ids["bos"],
             "eos_token_id": ids["eos"]}  # fmt: skip
    clash = sorted(set(fixed) & set(dims))
    if clash:
        raise CheckpointError(
            f"make_tiny_checkpoint: {', '.join(clash)} cannot be a dim: layers and the tokenizer's ids set it"
        )
    try:
        config = AutoConfig.for_model(spec.tiny_model_type, **spec.tiny_config({**fixed, **kwargs}))
    except (TypeError, ValueError) as exc:
        message = str(exc).replace("\n", " ")
        raise CheckpointError(
            f"make_tiny_checkpoint: {spec.name} config rejects {kwargs}: {message}"
        ) from exc
    try:  # the family's schema before a model is built from it (--dim num_experts_per_tok=99)
        spec.check_config(config.to_dict())
    except ConfigRefused as exc:
        raise CheckpointError(f"make_tiny_checkpoint: {spec.name} config: {exc}") from None
    vocab = config.get_text_config().vocab_size
    if vocab < 256 + len(SPECIAL_TOKENS):
        raise CheckpointError(f"make_tiny_checkpoint: vocab_size {vocab} < 259 byte-level tokens")
    import transformers

    cls = getattr(transformers, spec.tiny_class) if spec.tiny_class else AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (
            cls.from_config(config, dtype=getattr(torch, dtype))
            if spec.tiny_class is None
            else (cls._from_config(config, dtype=getattr(torch, dtype)))
        )
    with torch.no_grad():
        spec.tiny_values(model, torch.Generator().manual_seed(seed + 2))
    model.generation_config.pad_token_id = ids["pad"]
    model.generation_config.eos_token_id = ids["eos"]
    model.save_pretrained(out, max_shard_size=shard_bytes)
    write_release_config(spec, out)
    add_mtp_layers(spec, config.to_dict(), seed, dtype, out)


def write_release_config(spec, out: Path) -> None:
    """config.json as the family's published checkpoints write it (its `release_config`), where
    transformers' class that saved it is not the release's (MiMo's trunk is saved by Qwen2's)."""
    path = out / "config.json"
    saved = json.loads(path.read_text())
    release = spec.release_config(saved)
    if release != saved:
        path.write_text(json.dumps(release, indent=2, sort_keys=True) + "\n")


def _typed(model_type: str, values: dict[str, Any]) -> dict[str, Any]:
    """values with 0/1 turned into False/True where the config class's default is a bool."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type)
    return {
        k: bool(v) if isinstance(getattr(defaults, k, None), bool) and v in (0, 1) else v
        for k, v in values.items()
    }


def build_tokenizer(model_max_length: int = 4096):
    """A byte-level tokenizer with one token per byte, ChatML specials and a chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


MTP_SHARD = "model-mtp.safetensors"


def with_mtp_layers(spec, config: Mapping[str, Any], count: int | None = None) -> dict:
    """`config` deep enough that its class builds the MTP layers' decoder layers (L + k) as the
    decoder's: its per-layer lists re-derived for the deeper model, or given the MTP layers' kind
    where the family fixes it (`mtp_layer_kinds`). `count` when `config` is a multimodal release's
    text config (the MTP layers are counted at its top level)."""
    count = mtp_layers(config) if count is None else count
    deeper = {k: v for k, v in config.items() if k not in LAYER_LIST_KEYS}
    for key, kind in spec.mtp_layer_kinds.items():
        deeper[key] = list(config[key]) + [kind] * count
    deeper["num_hidden_layers"] = int(config["num_hidden_layers"]) + count
    return deeper


def add_mtp_layers(spec, config: dict, seed: int, dtype: str, out: Path) -> None:
    """Add the MTP layers `config` declares to the checkpoint in `out`, named as the family's
    published checkpoints name them, in a shard of their own (random values from `seed`).

    An MTP layer is a decoder layer (the one the class would build at index L + k) plus what the
    family's MTP block holds beside it (its `mtp_extras`: the projection that mixes the embedding
    with the previous hidden state, and its norms).
    """
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoConfig
    from transformers.core_model_loading import revert_weight_conversion

    from miles.ckpt.shards import INDEX_NAME

    config = spec.trunk_config(config)  # as transformers' class reads it (MiMo's: Qwen2's)
    text = text_config(config)
    count, layers = mtp_layers(config), text["num_hidden_layers"]
    if not count or spec.mtp_style is None:
        return
    # The class built one layer deeper, on the meta device, names and types the MTP block's tensors
    # (a multimodal release's decoder: its text config's causal LM).
    deeper = {k: v for k, v in with_mtp_layers(spec, text, count).items() if k != "auto_map"}
    with torch.device("meta"):
        if text is config:
            model = getattr(transformers, config["architectures"][0])._from_config(
                AutoConfig.for_model(**deeper), dtype=getattr(torch, dtype)
            )
        else:
            model = transformers.AutoModelForCausalLM.from_config(
                AutoConfig.for_model(**deeper), dtype=getattr(torch, dtype)
            )
    state = revert_weight_conversion(model, model.state_dict())
    norm_dtype = next(v.dtype for k, v in state.items() if k.endswith("norm.weight") and _layer(k) is None)
    hidden = int(text["hidden_size"])
    gen = torch.Generator().manual_seed(seed + 1)
    tensors: dict[str, torch.Tensor] = {}

    def make(name: str, shape, kind) -> None:
        module, param = name.rsplit(".", 2)[-2:]
        if "norm" in module:  # norms start as the identity, as transformers initializes them
            value = torch.ones(shape) if param == "weight" else torch.zeros(shape)
        else:
            value = torch.randn(shape, generator=gen) * 0.02
        tensors[name] = value.to(kind).contiguous()

    kinds = {"model": getattr(torch, dtype), "norm": norm_dtype}
    for k in range(count):
        prefix = mtp_layer_prefix(spec.mtp_style, layers, k)
        for name, value in sorted(state.items()):
            if _layer(name) == layers + k and value.is_floating_point():
                make(prefix + LAYER_RE.match(name)["rest"], value.shape, value.dtype)
        for name, shape, like in spec.mtp_extras(prefix, text, hidden):
            make(name, shape, kinds.get(like) or next(v.dtype for n, v in state.items() if like in n))
    spec.tiny_mtp_values(tensors, torch.Generator().manual_seed(seed + 3))
    save_file(tensors, out / MTP_SHARD, metadata={"format": "pt"})
    index_path = out / INDEX_NAME
    index = json.loads(index_path.read_text())
    index["weight_map"].update({name: MTP_SHARD for name in tensors})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in tensors.values())
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _layer(name: str) -> int | None:
    m = LAYER_RE.match(name)
    return int(m["index"]) if m else None
