"""Tiny random checkpoints of the recipes' real architectures, built locally without network.

The model is the family's own transformers class (AutoModelForCausalLM.from_config) with
random weights from a seed, saved sharded with an index like a hub checkpoint. The
tokenizer is byte-level with one token per byte, so every digit, letter and symbol of a
synthetic task is a single token and nothing is ever unknown; it carries a ChatML chat
template. Same arguments, same bytes: the CPU lane's runs are reproducible.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles.ckpt.errors import CheckpointError
from miles.ckpt.families import family as get_family
from miles.ckpt.manifest import atomic_dir, finished, write_manifest

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0, 1, 2
DEFAULT_SHARD_BYTES = 1_000_000  # small enough that every tiny checkpoint has several shards
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_STEP = "tiny"


def tiny_params(family: str, layers: int, seed: int, dtype: str, shard_bytes: int, dims: Mapping[str, Any]):
    """What a tiny checkpoint is a function of; its manifest records exactly this."""
    return {
        "family": family,
        "layers": layers,
        "seed": seed,
        "dtype": dtype,
        "shard_bytes": shard_bytes,
        "dims": dict(dims),
    }


def make_tiny_checkpoint(
    family: str,
    layers: int,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    **dims: Any,
) -> Path:
    """Build (or find already built) a random `layers`-deep checkpoint of `family` in `out_dir`.

    `dims` override the family's tiny config (hidden_size=2048, vocab_size=32768, ...), which
    is how the benchmarks make multi-GB checkpoints with the same code.
    """
    spec = get_family(family)
    if layers < 1:
        raise CheckpointError(f"make_tiny_checkpoint: layers must be >= 1, got {layers}")
    out = Path(out_dir)
    params = tiny_params(family, layers, seed, dtype, shard_bytes, dims)
    if finished(out, TINY_STEP, f"tiny:{family}", params):
        return out
    with atomic_dir(out) as tmp:
        _save_model(spec, layers, seed, dtype, shard_bytes, dims, tmp)
        build_tokenizer(
            int(dims.get("max_position_embeddings", spec.tiny_dims["max_position_embeddings"]))
        ).save_pretrained(tmp)
        write_manifest(tmp, TINY_STEP, f"tiny:{family}", params)
    return out


def _save_model(spec, layers: int, seed: int, dtype: str, shard_bytes: int, dims, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = {
        name: SPECIAL_TOKENS.index(tok)
        for name, tok in (("pad", PAD_TOKEN), ("bos", PAD_TOKEN), ("eos", EOS_TOKEN))
    }
    kwargs = {**spec.tiny_dims, **dims}
    try:
        config = AutoConfig.for_model(
            spec.tiny_model_type,
            num_hidden_layers=layers,
            pad_token_id=ids["pad"],
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            tie_word_embeddings=False,
            **kwargs,
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"make_tiny_checkpoint: {spec.name} config rejects {kwargs}: {exc}") from exc
    if config.vocab_size < 256 + len(SPECIAL_TOKENS):
        raise CheckpointError(f"make_tiny_checkpoint: vocab_size {config.vocab_size} < 259 byte-level tokens")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.pad_token_id = ids["pad"]
    model.generation_config.eos_token_id = ids["eos"]
    model.save_pretrained(out, max_shard_size=shard_bytes)


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
