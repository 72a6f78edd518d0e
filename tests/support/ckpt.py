"""Tiny checkpoints and their torch_dist forms for tests: from the cache a lane run shares.

Every test file of a lane run (and every test of one pytest session) asks the same cache
(miles.ckpt.tiny_cache, in `$MILES_TINY_CACHE`: the runner sets one per lane run; without it the
first test to ask makes one for its process and the processes it starts, removed at exit), so a
family and size is built once and verified on every use.
A cached checkpoint is shared: a test that changes one works on `private(...)`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from miles.ckpt.tiny_cache import CACHE_ENV, TinyCheckpoint, copy_of, tiny_checkpoint


def cache_folder() -> Path:
    given = os.environ.get(CACHE_ENV)
    if not given:
        given = tempfile.mkdtemp(prefix="miles-tiny-")
        os.environ[CACHE_ENV] = given  # the processes the tests start share it
        atexit.register(shutil.rmtree, given, True)
    return Path(given)


def tiny(family: str, layers: int, *, torch_dist: bool = False, **kwargs: Any) -> TinyCheckpoint:
    """The tiny `family` checkpoint of `layers` layers (make_tiny_checkpoint's keywords), and its
    torch_dist form with `torch_dist`."""
    return tiny_checkpoint(family, layers, torch_dist=torch_dist, root=cache_folder(), **kwargs)


def tiny_hf(family: str, layers: int, **kwargs: Any) -> Path:
    return tiny(family, layers, **kwargs).hf


def private(entry: Path, into: Path) -> Path:
    """A copy of a cached folder that the test may change."""
    return copy_of(entry, into)


def trunk_of(path: str) -> dict:
    """from_pretrained's config for a checkpoint whose trunk loads as another model type's class
    (MiMo's: Qwen2's; miles.families.trunk_loads), else nothing."""
    import json
    from pathlib import Path

    from miles.families import transformers_config, trunk_loads

    config = json.loads((Path(path) / "config.json").read_text())
    return {"config": transformers_config(config)} if trunk_loads(config) else {}


def perturbed(family: str, layers: int, root: Path, **dims: Any) -> Path:
    """A float32 tiny checkpoint (`root`/hf) whose norms, norm biases and expert biases, the MTP
    layers' too, are not at the constants transformers starts them at (1, 0, 0): a norm left at 1
    hides a norm applied to the wrong tensor, or not at all."""
    import json

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from miles.ckpt.families import family as get_family
    from miles.ckpt.tiny import MTP_SHARD, add_mtp_layers, make_tiny_checkpoint, write_release_config

    source = make_tiny_checkpoint(family, layers, root / "source", dtype="float32", progress=False, **dims)
    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **trunk_of(source))
    moved = off_start()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            new = moved(name, tensor)
            if new is not None:
                tensor.copy_(new)
    out = root / "hf"
    model.save_pretrained(out, max_shard_size=1_000_000)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    write_release_config(get_family(family), out)  # MiMo's names its release's class, not its trunk's
    config = json.loads((out / "config.json").read_text())
    add_mtp_layers(get_family(family), config, 0, "float32", out)  # save_pretrained drops them
    if (out / MTP_SHARD).exists():
        move_mtp_shard(out, moved)
    return out


def off_start(seed: int = 7):
    """`moved(name, tensor)`: the tensor moved off the constant transformers starts it at (a norm by
    N(0, 0.3), an expert bias drawn from N(0, 0.05)), or None for a tensor left as it is; one
    generator for every call."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def moved(name: str, tensor):
        if "norm" in name:
            return tensor + torch.randn(tensor.shape, generator=gen) * 0.3
        if name.endswith("e_score_correction_bias"):
            return torch.randn(tensor.shape, generator=gen) * 0.05
        return None

    return moved


def move_mtp_shard(checkpoint: Path, moved) -> None:
    """Apply `moved` (off_start's) to every tensor of the checkpoint's MTP shard, in name order."""
    from safetensors.torch import load_file, save_file

    from miles.ckpt.tiny import MTP_SHARD

    tensors = load_file(checkpoint / MTP_SHARD)
    for name in sorted(tensors):
        new = moved(name, tensors[name])
        tensors[name] = tensors[name] if new is None else new.contiguous()
    save_file(tensors, checkpoint / MTP_SHARD, metadata={"format": "pt"})


def near_tied_checkpoint(
    family: str, layers: int, root: Path, lead: float = 4.0, spacing: float = 1e-6, head_scale: float = 1.0
) -> tuple[Path, Path]:
    """(HF, torch_dist) of the float32 tiny `family` whose MoE routers hold top-k + 1 near-equal leading
    rows (`spacing` apart, `lead` times the others' scale): each token's top-k is a near-tie among
    them, which the rollout engine's cached decode and the trainer's whole-sequence forward round apart.
    `head_scale` multiplies the output layer (a tiny whose logits are near zero shows a routing
    change by little in its logprobs)."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles.ckpt.families import family as get_family
    from miles.ckpt.tiny import add_mtp_layers
    from miles.ckpt.torch_dist import convert_to_torch_dist

    source = tiny_hf(family, layers, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None:  # a dense layer
                continue
            weight = gate.weight
            row = weight[0] * lead
            tied = model.config.num_experts_per_tok + 1  # one more than a token picks
            for expert in range(tied):
                weight[expert] = row + spacing * torch.randn(weight.shape[1], generator=gen)
            # an expert bias that only selects (sigmoid, sqrt-softplus routers) would part them
            bias = getattr(gate, "e_score_correction_bias", None)
            if bias is not None:
                bias[:tied] = bias[:tied].max()
        model.lm_head.weight.mul_(head_scale)
    hf = root / "hf"
    model.save_pretrained(hf, max_shard_size=1_000_000)  # sharded, with the index the MTP shard joins
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, hf / name)
    add_mtp_layers(get_family(family), model.config.to_dict(), 0, "float32", hf)  # save_pretrained drops them
    dist = root / "torch_dist"
    dist.mkdir()
    # The converter's own check compares the loaded-back model's logits with transformers' within
    # 1e-4 under each forward's own routing; with router rows 1e-6 apart the two forwards' rounding
    # picks different experts on some machines (glm4_moe_lite: 0.054 on one 2-core machine, below
    # 1e-4 on another), which is what this checkpoint is for, not a wrong mapping. The tests that use
    # it hold the converted model to the engine's logprobs under one routing (R3: the float32 floor),
    # which a wrong mapping cannot pass.
    convert_to_torch_dist(hf, dist, family, verify=False)
    return hf, dist
