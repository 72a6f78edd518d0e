"""Loading the policy, reference and tokenizer from a Hugging Face checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class ModelLoadError(RuntimeError):
    """A checkpoint directory cannot be loaded as a causal LM; names the directory and the fix."""

    same_on_every_rank = True  # every rank loads the same directory


def train_dtype(bf16: bool) -> torch.dtype:
    """The compute dtype of `--bf16` (master weights stay float32), the same on every device."""
    return torch.bfloat16 if bf16 else torch.float32


def is_hf_dir(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def require_hf_dir(path: str | Path) -> Path:
    path = Path(path)
    if not is_hf_dir(path):
        raise ModelLoadError(
            f"{path}: no config.json; --hf-checkpoint must be a Hugging Face model directory "
            "(e.g. one made by `invoke make-tiny-ckpt` or `invoke prepare-ckpt`)"
        )
    return path


def load_causal_lm(path: str | Path, *, dtype: torch.dtype, device: str = "cpu"):
    """The Hugging Face model of `path` (its own architecture class), on `device`."""
    from transformers import AutoModelForCausalLM

    from miles.families import transformers_config, trunk_loads

    path = require_hf_dir(path)
    config = json.loads((path / "config.json").read_text())
    # a family whose release class transformers lacks loads its trunk with a built-in class (MiMo: Qwen2's)
    trunk = trunk_loads(config)
    if config.get("auto_map") and not trunk:
        raise ModelLoadError(
            f"{path}/config.json has auto_map (remote code); miles loads built-in classes only"
        )
    given = {"config": transformers_config(config)} if trunk else {}
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="sdpa", **given
            )
        except ValueError as exc:
            if "attention implementation" not in str(exc):
                raise
            # Some architectures (deepseek_v4) have only their own attention; eager is exact.
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="eager", **given
            )
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(
            f"{path}: cannot load as a causal LM ({config.get('model_type')}): {exc}"
        ) from exc
    return model.to(device)


def empty_causal_lm(path: str | Path, *, dtype: torch.dtype):
    """The model of `path` on the meta device (no memory, no weights), with the attention
    implementation load_causal_lm would choose."""
    from transformers import AutoModelForCausalLM

    from miles.families import transformers_config

    config = transformers_config(require_hf_dir(path))
    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        except ValueError as exc:
            if "attention implementation" not in str(exc):
                raise
            return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(require_hf_dir(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """Every id that ends a response: the tokenizer's eos and the generation config's (of a
    loaded model, or of the checkpoint directory `model` names)."""
    if isinstance(model, (str, Path)):
        from transformers import GenerationConfig

        has_config = (Path(model) / "generation_config.json").is_file()
        generation = GenerationConfig.from_pretrained(model) if has_config else None
    else:
        generation = model.generation_config
    ids: list[int] = []
    for value in (tokenizer.eos_token_id, getattr(generation, "eos_token_id", None)):
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(int(v) for v in value)
    return tuple(dict.fromkeys(ids))


CAUSALITY_TOL = 1e-3  # float32: a causal forward's logits move by ~1e-6 when tokens are appended
CAUSALITY_ULPS = 4  # lower precisions: rounding alone moves them by about one unit in the last place


def causality_leak(model, *, length: int = 40, prefix: int = 24, seed: int = 0) -> float:
    """How much the logits of the first `prefix` positions change when tokens are appended."""
    return causality_probe(model, length=length, prefix=prefix, seed=seed)[0]


def causality_probe(model, *, length: int = 40, prefix: int = 24, seed: int = 0) -> tuple[float, float]:
    """(leak, tolerance): how much the logits of the first `prefix` positions change when tokens
    are appended, and how much float noise alone may move them in the model's dtype.

    A causal LM gives float noise: ~1e-6 in float32, a unit in the last place of the logits in
    bfloat16 (measured: 0.0049 on a tiny Qwen3 whose logits reach 1.56). The tolerance is
    CAUSALITY_TOL, or CAUSALITY_ULPS units in the last place of the largest logit in the
    model's dtype when that is more. transformers 5.x's glm_moe_dsa is not causal once a
    sequence is longer than its sparse-attention top-k: its full forward lets later tokens
    change earlier positions (0.06 on the tiny one, float32 and bfloat16 alike), so no rollout
    engine can reproduce the trainer's logprobs.
    """
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    vocab = min(int(model.config.vocab_size), 250)
    ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed)).to(device)
    with torch.no_grad():
        full = model(input_ids=ids).logits[0, :prefix].float()
        cut = model(input_ids=ids[:, :prefix]).logits[0].float()
    tolerance = CAUSALITY_TOL
    if dtype.is_floating_point and torch.finfo(dtype).bits < 32:
        tolerance = max(tolerance, CAUSALITY_ULPS * torch.finfo(dtype).eps * full.abs().max().item())
    return (full - cut).abs().max().item(), tolerance


def with_value_head(model):
    """`model` with its vocabulary head replaced by a zero-initialised one-output linear head: PPO's
    critic, the policy's network predicting a value at each position (its logits are [B, T, 1]).
    The head starts at zero so the first values are 0 and the first value steps train the head
    alone; a head tied to the input embedding is untied."""
    embedding = model.get_input_embeddings().weight
    hidden = model.config.get_text_config().hidden_size
    head = torch.nn.Linear(hidden, 1, bias=False, device=embedding.device, dtype=embedding.dtype)
    if embedding.device.type != "meta":
        with torch.no_grad():
            head.weight.zero_()
    model.config.tie_word_embeddings = False
    model.config.get_text_config().tie_word_embeddings = False
    model.set_output_embeddings(head)
    return model
