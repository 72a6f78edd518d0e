"""LoRA adapters on the FSDP/DDP policy, in Hugging Face PEFT's own form (`--lora-rank`).

The policy is the transformers model wrapped by `peft.get_peft_model` (`--target-modules`, default
all-linear: every linear layer but the output head, `--lora-alpha`, `--lora-dropout`): each
targeted weight W stays frozen, and the trained A [r, in] and B [out, r] (B zero at the start, so
the first policy is the base model) add (alpha / r) B A x to its output. What leaves the trainer:

- the rollout engine gets merged weights under the base model's names, W + (alpha / r) B A,
  computed from copies (the base tensors are never changed, so nothing drifts by rounding);
- a checkpoint holds the adapters and their optimizer state only, and, beside them, the adapters
  as PEFT saves them (`adapter/adapter_model.safetensors` and `adapter_config.json`:
  `PeftModel.from_pretrained(base, dir)` loads them); a resumed run loads the base from
  --hf-checkpoint and the adapters from the checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from miles.train.config import LoraConfig

ADAPTER_DIR = "adapter"  # the PEFT-format copy of the adapters in each checkpoint directory
ALL_LINEAR = "all-linear"
_BASE, _A, _B = ".base_layer.", ".lora_A.default.", ".lora_B.default."


def targets(settings: LoraConfig) -> str | list[str]:
    """peft's target_modules: "all-linear", or the names listed (HF spelling)."""
    value = settings.target_modules or ALL_LINEAR
    return ALL_LINEAR if value == ALL_LINEAR else [name.strip() for name in value.split(",") if name.strip()]


def is_adapter(name: str) -> bool:
    """Whether a state-dict key is an adapter's (A or B of a LoRA layer)."""
    return ".lora_A." in name or ".lora_B." in name


def peft_config(settings: LoraConfig, base: str):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        target_modules=targets(settings),
        base_model_name_or_path=base,
        task_type="CAUSAL_LM",
    )


def wrap(model, settings: LoraConfig, base: str):
    """The model with adapters (peft's PeftModel); only the adapters require gradients."""
    from peft import get_peft_model

    return get_peft_model(model, peft_config(settings, base))


def merged(named: Iterable[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's tensors from the adapted model's (peft names: `<module>.base_layer.weight`,
    `<module>.lora_A.default.weight`, `<module>.lora_B.default.weight`): each adapted weight merged
    as W + scaling B A into a new tensor, under the base model's names, one module at a time."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        tag = next((t for t in (_BASE, _A, _B) if t in name), None)
        if tag is None:
            yield name, tensor
            continue
        module, rest = name.split(tag, 1)
        if tag == _BASE and rest != "weight":  # the base layer's bias: not adapted
            yield f"{module}.{rest}", tensor
            continue
        parts = held.setdefault(module, {})
        parts[tag] = tensor
        if len(parts) == 3:
            del held[module]
            base, a, b = parts[_BASE], parts[_A], parts[_B]
            yield f"{module}.weight", (base.float() + (b.float() @ a.float()) * scaling).to(base.dtype)


def save_adapter(
    directory: str | Path,
    adapter_state: dict[str, torch.Tensor],
    settings: LoraConfig,
    base: str,
    *,
    target_modules: list[str] | None = None,
) -> None:
    """The adapters as PEFT writes them: `adapter_model.safetensors` under PEFT's names and its
    `adapter_config.json` (rank 0 calls it with the full adapter tensors); `target_modules`, the
    HF modules adapted where they are not --target-modules' own spelling (Megatron's fused layers)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {_peft_name(k): v.detach().cpu().contiguous() for k, v in adapter_state.items()}
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = peft_config(settings, base).to_dict()
    if target_modules is not None:
        config["target_modules"] = list(target_modules)
    config["target_modules"] = (
        sorted(config["target_modules"])
        if isinstance(config["target_modules"], set)
        else config["target_modules"]
    )
    config["peft_type"] = str(getattr(config["peft_type"], "value", config["peft_type"]))
    config["task_type"] = str(getattr(config["task_type"], "value", config["task_type"]))
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")


def _peft_name(name: str) -> str:
    """PEFT's saved name: the adapter's name ("default") left out, under the wrapper's prefix."""
    name = name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
    return name if name.startswith("base_model.model.") else f"base_model.model.{name}"
