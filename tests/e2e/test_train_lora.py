"""LoRA on the training backends: only the adapters train, and the rollout engine gets W + (alpha/r) B A.

tests/e2e/lora_worker.py builds the policy from a trainer command with --lora-rank 4 --lora-alpha 8
on two gloo ranks (FSDP: data parallel over both), trains three steps on fixed samples, saves,
and loads the checkpoint into a second backend. Checked: only the adapters require gradients and
every frozen base tensor is bit-identical after training; before training the weights handed to
the engine are the checkpoint's own (B starts at zero), after it each adapted weight is exactly
W + 2 B A (peft's scaling alpha / r) of the trained adapters, and equals what peft's own
merge_and_unload makes of the base and the PEFT-format adapter the checkpoint holds; the loaded
backend hands the engine the same weights. The tiny recipe's own command with --lora-rank trains
three rollouts with its --ci-test checks on (the engine's weights equal the trainer's merged ones
bit for bit after every sync, rollout and trainer logprobs within 1e-3) and checkpoints only the
adapters, with their PEFT-format copy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.ci.register import register_cpu_ci
from tests.support import recipes as runs

register_cpu_ci(est_time=15, suite="stage-b-cpu")

WORKER = Path(__file__).with_name("lora_worker.py")
SCALING = 8 / 4


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from miles.ckpt.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("qwen3", 2, tmp_path_factory.mktemp("qwen3") / "hf", progress=False)


@pytest.fixture(scope="module")
def fsdp_lora(tiny_qwen3, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-lora")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           "fsdp", str(tiny_qwen3), str(out)]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return out, [torch.load(out / f"lora-{r}.pt") for r in range(2)]


def _hf_name(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def test_only_the_adapters_train_and_the_base_is_bit_identical(fsdp_lora):
    _, results = fsdp_lora
    for result in results:
        assert result["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in result["trainable"])
        assert result["frozen_before"].keys() == result["frozen_after"].keys()
        for name, tensor in result["frozen_before"].items():
            assert torch.equal(tensor, result["frozen_after"][name]), name
        print(
            f"{len(result['trainable'])} adapter tensors trained, {len(result['frozen_before'])} base tensors bit-identical"
        )
        assert all(n > 0 for n in result["norms"])


def test_the_engine_gets_the_base_plus_the_scaled_adapters(fsdp_lora):
    _, results = fsdp_lora
    result = results[0]
    adapters = result["adapters"]
    adapted = {k.split(".lora_A.")[0] for k in adapters if ".lora_A." in k}
    assert adapted
    for module in adapted:
        name = _hf_name(f"{module}.base_layer.weight")
        w = result["frozen_after"][f"{module}.base_layer.weight"]
        a, b = adapters[f"{module}.lora_A.default.weight"], adapters[f"{module}.lora_B.default.weight"]
        assert torch.equal(result["before"][name], w), name  # B starts at zero: the base itself
        assert torch.equal(
            result["after"][name], (w.float() + (b.float() @ a.float()) * SCALING).to(w.dtype)
        ), name
        assert not torch.equal(result["after"][name], w), name
    untouched = [
        n for n in result["after"] if not any(n == _hf_name(f"{m}.base_layer.weight") for m in adapted)
    ]
    for name in untouched:
        assert torch.equal(result["after"][name], result["before"][name]), name
    for other in results[1:]:
        for name, tensor in result["after"].items():
            assert torch.equal(other["after"][name], tensor), name


def test_the_checkpoint_holds_peft_adapters_that_peft_merges_to_the_same_weights(fsdp_lora, tiny_qwen3):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, results = fsdp_lora
    base = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(out / "ckpt" / "adapter")).merge_and_unload().state_dict()
    for name, tensor in results[0]["after"].items():
        assert torch.allclose(merged[name].float(), tensor.float(), rtol=1e-6, atol=1e-7), name


def test_a_loaded_checkpoint_restores_the_adapters_on_the_base(fsdp_lora):
    _, results = fsdp_lora
    for result in results:
        for name, tensor in result["after"].items():
            assert torch.equal(result["loaded"][name], tensor), name


def test_the_recipe_trains_with_adapters_and_checkpoints_them(tmp_path):
    plan = runs.tiny_plan(
        "qwen3_4b", tmp_path, "--lora-rank", "4", "--lora-alpha", "8", "--num-rollout", "3", "--save-interval", "3",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
        train_backend="fsdp",
    )  # fmt: skip
    assert "--ci-test" in plan.train_args
    assert runs.launch(plan, tmp_path / "record") == 0
    assert sorted(runs.series(tmp_path / "record", "train/grad_norm")) == [0, 1, 2]
    saved = runs.checkpoint_dir(plan) / "iter_0000003"
    assert {p.name for p in (saved / "adapter").iterdir()} == {
        "adapter_model.safetensors",
        "adapter_config.json",
    }
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:5]
