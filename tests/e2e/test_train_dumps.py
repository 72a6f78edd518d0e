"""Tensor dumps (`--dumper-enable`, miles.train.dumps) of the tiny Qwen3 recipe's first rollout on two
gloo ranks, with each training backend, checked against the model itself.

The recipe's own command runs one rollout with the seed's dumper flags (radixark/miles 31f1ca961,
tests/e2e/short/test_dumper.py: `--dumper-enable --dumper-dir D --dumper-fwd-bwd
enable_model_value=0 enable_model_grad=0 'filter=...'`; here enable_model_grad=1 so the gradients
are dumped too). Each phase's folder holds every rank's files, named by their tags, and a manifest
naming each tensor's shape; the logits dumped by the logprob forward (fwd_only) equal the logits
transformers' model of the starting checkpoint computes from the dumped inputs (FSDP: whole; Megatron
at TP=2: each rank's vocabulary half); the filter keeps only the layers it names.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch

from miles.ci.register import register_cpu_ci
from tests.support import recipes as runs

register_cpu_ci(est_time=7, suite="stage-b-cpu")

FILTER = "filter=layer_id is None or layer_id < 1"
ARGS = (
    "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
    "--rollout-max-response-len", "4", "--global-batch-size", "4", "--micro-batch-size", "2",
    "--dumper-enable", "--dumper-fwd-only", FILTER, "--dumper-fwd-bwd", "enable_model_grad=1", FILTER,
)  # fmt: skip
TAGS = re.compile(r"step=(\d+)___rank=(\d+)___dump_index=(\d+)___name=(.+?)(?:___layer_id=(\d+))?\.pt$")


def _dumps(tmp_path_factory, backend: str):
    workdir = tmp_path_factory.mktemp(f"dumps-{backend}")
    dump_dir = workdir / "dumps"
    plan = runs.tiny_plan("qwen3_4b", workdir, *ARGS, "--dumper-dir", str(dump_dir), train_backend=backend)
    assert runs.launch(plan, workdir / "record") == 0
    return plan, dump_dir


@pytest.fixture(scope="module")
def fsdp_dumps(tmp_path_factory):
    return _dumps(tmp_path_factory, "fsdp")


@pytest.fixture(scope="module")
def megatron_dumps(tmp_path_factory):
    return _dumps(tmp_path_factory, "megatron")


def _files(folder: Path) -> dict[tuple[int, int, str], tuple[Path, int | None]]:
    """(step, rank, name) -> (file, layer_id) of a phase's dump folder."""
    out = {}
    for path in folder.glob("*.pt"):
        step, rank, _, name, layer = TAGS.fullmatch(path.name).groups()
        out[int(step), int(rank), name] = (path, None if layer is None else int(layer))
    return out


def _value(files, rank: int, name: str) -> torch.Tensor:
    return torch.load(files[0, rank, name][0], weights_only=False)["value"]


def _hf_logits(plan, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(plan.checkpoint.hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_each_phase_writes_every_ranks_tensors_and_a_manifest(backend, request):
    _, dump_dir = request.getfixturevalue(f"{backend}_dumps")
    for phase in ("fwd_only", "fwd_bwd"):
        folder = dump_dir / phase / "rollout_0"
        files = _files(folder)
        for rank in (0, 1):
            manifest = json.loads((folder / f"manifest_rank={rank}.json").read_text())
            assert not manifest["truncated"]
            mine = {name for (_, r, name) in files if r == rank}
            assert {entry["name"] for entry in manifest["files"]} == mine
            for entry in manifest["files"]:
                value = torch.load(folder / entry["file"], weights_only=False)
                assert list(value["value"].shape) == entry["shape"], entry
                assert value["meta"]["rank"] == rank and value["meta"]["world_size"] == 2
            assert "input_ids" in mine
            assert any(name.endswith(".output") for name in mine)
    grads = [n for (_, _, n) in _files(dump_dir / "fwd_bwd" / "rollout_0") if n.startswith("grad__param__")]
    assert grads and not any(
        n.startswith("grad__") for (_, _, n) in _files(dump_dir / "fwd_only" / "rollout_0")
    )


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_the_filter_keeps_only_the_layers_it_names(backend, request):
    _, dump_dir = request.getfixturevalue(f"{backend}_dumps")
    layers = {layer for _, layer in _files(dump_dir / "fwd_bwd" / "rollout_0").values()}
    assert layers == {None, 0}  # the tiny model has 2 layers; layer 1 is filtered out


def test_fsdp_dumped_logits_are_the_models_logits_of_the_dumped_inputs(fsdp_dumps):
    plan, dump_dir = fsdp_dumps
    files = _files(dump_dir / "fwd_only" / "rollout_0")
    for rank in (0, 1):
        inputs = {k: _value(files, rank, k) for k in ("input_ids", "attention_mask", "position_ids")}
        expected = _hf_logits(plan, inputs)
        torch.testing.assert_close(
            _value(files, rank, "output.logits").float(), expected, rtol=1e-4, atol=1e-4
        )


def test_megatron_tp2_dumped_logits_are_the_vocabulary_halves_of_the_models_logits(megatron_dumps):
    plan, dump_dir = megatron_dumps
    files = _files(dump_dir / "fwd_only" / "rollout_0")
    load = functools.partial(_value, files)
    input_ids = load(0, "input_ids")
    assert torch.equal(input_ids, load(1, "input_ids"))  # tensor parallel: the same rows on both ranks
    positions = load(0, "position_ids")
    halves = torch.cat([load(0, "output"), load(1, "output")], dim=-1).float()  # [rows, width, vocab]
    expected = _hf_logits(plan, {"input_ids": input_ids, "position_ids": positions})
    # the dumped inputs are one micro-batch padded to a multiple of the layout's width; padding
    # rows and columns hold pad tokens whose logits are compared too (a causal model's real
    # tokens never see the ones after them)
    torch.testing.assert_close(halves, expected, rtol=1e-4, atol=1e-4)
