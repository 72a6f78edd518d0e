"""FSDP loads shard by shard and exports tensor by tensor, with the weights and names of before.

Two gloo ranks (one launch for all three models) build the FSDP backend from a trainer command (fsdp_shards_worker.py): every
rank builds the model empty and shards it, rank 0 reads the checkpoint, and each tensor is
broadcast with each rank keeping its shard. Beside it the worker builds the model the way
the backend did before (whole on every rank, then sharded). Both must hold the same
parameters, buffers, tied parameters and logits; the export must give, one tensor at a
time and in the engine's dtype (bf16 here), exactly the tensors of the old export (the whole
gathered state dict, cast afterwards), under the checkpoint files' names and the model's.

Three models: a dense Qwen3 with tied embeddings, a Qwen3-MoE (transformers fuses each
layer's experts; their checkpoint names come back per expert from one tensor), and
hrm_text, whose gate/up and gate/q/k/v model tensors were split from one checkpoint tensor
each: reverted one at a time they would each claim the whole checkpoint name with a part of
its rows, so they are held and reverted together.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import ranks
from tests.support.ckpt import tiny_hf

register_cpu_ci(est_time=10, suite="stage-b-cpu")

WORKER = Path(__file__).with_name("fsdp_shards_worker.py")


def _hrm_text(out: Path) -> Path:
    """A one-layer hrm_text checkpoint, saved by transformers under its checkpoint names."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.hrm_text import HrmTextConfig

    config = HrmTextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


MODELS = ("qwen3", "qwen3_moe", "hrm_text")


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Every model's checkpoint and the folder of its ranks' results: one launch of the worker."""
    root = tmp_path_factory.mktemp("fsdp-shards")
    models = {name: tiny_hf(name, 2) for name in MODELS[:2]}
    models["hrm_text"] = _hrm_text(root / "hrm_text")
    cases = {name: (hf, root / "out" / name) for name, hf in models.items()}
    ranks.succeeded(ranks.launch(WORKER, json.dumps([[str(hf), str(out)] for hf, out in cases.values()])))
    return cases


@pytest.fixture(scope="module", params=MODELS)
def exported(request, launched):
    """Each rank's results of the worker on the parameter's model."""
    import torch

    hf, out = launched[request.param]
    return request.param, hf, [torch.load(out / f"state-{r}.pt", weights_only=False) for r in (0, 1)]


def _same(a: dict, b: dict) -> None:
    import torch

    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for name in a:
        assert a[name].dtype == b[name].dtype, (name, a[name].dtype, b[name].dtype)
        assert torch.equal(a[name], b[name]), name


def test_sharded_load_holds_the_weights_of_the_whole_load(exported):
    import torch

    _, _, ranks = exported
    for result in ranks:
        _same(result["state"], result["state_before"])
        _same(result["buffers"], result["buffers_before"])
        assert result["tied"] == result["tied_before"]
        assert torch.equal(result["logits"], result["logits_before"])


def test_export_gives_the_old_export_in_the_engine_dtype_one_tensor_at_a_time(exported):
    import torch

    _, _, ranks = exported
    for result in ranks:
        for key in ("export", "export_model_names"):
            stream = result[key]
            assert len(stream["names"]) == len(set(stream["names"])), f"{key}: a name handed out twice"
            floats = [t.dtype for t in stream["tensors"].values() if t.is_floating_point()]
            assert set(floats) == {torch.bfloat16}, (key, set(floats))
            # the exporter keeps at most one model tensor's worth of what it handed out
            largest = max(t.nbytes for t in result["export_before_model_names"].values())
            assert stream["held"] <= largest, (key, stream["held"], largest)
        _same(result["export_model_names"]["tensors"], result["export_before_model_names"])
        _same(result["export"]["tensors"], result["export_before"])


def test_checkpoint_names_are_the_files_names(exported):
    """By checkpoint name the export is the checkpoint itself: every file tensor, once, in bf16
    (and a tied parameter under its second name too, as the state dict has it)."""
    import torch
    from safetensors.torch import load_file

    family, hf, ranks = exported
    files = {}
    for shard in sorted(hf.glob("*.safetensors")):
        files.update(load_file(shard))
    for result in ranks:
        export = result["export"]["tensors"]
        tied = {second: first for first, second in result["tied"]}
        assert sorted(export) == sorted([*files, *tied]), sorted(set(export) ^ {*files, *tied})
        for name, first in tied.items():
            assert torch.equal(export[name], export[first]), name
        for name, tensor in files.items():
            want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            assert torch.equal(export[name], want), (family, name)
