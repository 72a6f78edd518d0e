"""LoRA on the Megatron backend: only the adapters train, split as their layers are under tensor parallelism.

tests/e2e/lora_worker.py builds the Megatron policy of a tiny Qwen3 (its torch_dist form) from a
trainer command with --lora-rank 4 --lora-alpha 8 at TP2 with sequence parallelism on two gloo
ranks, trains three steps on fixed samples, saves, and loads the checkpoint into a second backend.
Checked: only the adapters require gradients and the optimizer holds nothing else, every frozen
base tensor is bit-identical after training; the weights handed to the engine are the HF
checkpoint's own before training (B starts at zero) and, after it, W + 2 B A computed from the
base and the PEFT-format adapters the checkpoint holds (which peft's merge_and_unload turns into
the same weights); the checkpoint holds the adapters and no base weight, and the loaded backend
hands over the same weights. With the adapters of that checkpoint, the first-step loss at TP2+SP
equals TP1's (the checkpoint resharded) and the FSDP path's (peft loading the PEFT copy), rel 1e-5.
The tiny recipe's own command on Megatron with --lora-rank trains two rollouts with its --ci-test
checks on (the engine's weights equal the trainer's merged ones after every sync) and checkpoints
only the adapters, with their PEFT-format copy.
"""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
import torch

from miles.ci.register import register_cpu_ci
from tests.support.ckpt import tiny
from tests.support.ranks import launch, succeeded

register_cpu_ci(est_time=20, suite="stage-b-cpu")

WORKER = Path(__file__).with_name("lora_worker.py")
SCALING = 8 / 4


@pytest.fixture(scope="module")
def qwen3():
    return tiny("qwen3", 2, torch_dist=True)


@pytest.fixture(scope="module")
def trained(qwen3, tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron-lora")
    succeeded(launch(WORKER, "megatron", qwen3.hf, qwen3.torch_dist, out, nproc=2))
    return out, [torch.load(out / f"lora-{r}.pt") for r in range(2)]


def _hf_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(glob.glob(f"{path}/*.safetensors")):
        out.update(load_file(file))
    return out


def _peft_adapters(ckpt: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module -> (A, B) of the PEFT-format copy in the checkpoint."""
    from safetensors.torch import load_file

    saved = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    return {
        name.removeprefix("base_model.model.").removesuffix(".lora_A.weight"): (
            tensor,
            saved[name.replace(".lora_A.", ".lora_B.")],
        )
        for name, tensor in saved.items()
        if ".lora_A." in name
    }


def test_only_the_adapters_train_and_the_base_is_bit_identical(trained):
    _, results = trained
    for result in results:
        assert result["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in result["trainable"])
        # every adapted layer of both decoder layers: linear_qkv, linear_proj, linear_fc1, linear_fc2
        assert len(result["trainable"]) == 2 * 4 * 2
        assert result["optimizer_numel"] == result["trainable_numel"] > 0
        assert result["frozen_before"].keys() == result["frozen_after"].keys()
        for name, tensor in result["frozen_before"].items():
            assert torch.equal(tensor, result["frozen_after"][name]), name
        assert all(n > 0 for n in result["norms"])


def test_the_engine_gets_the_base_plus_the_scaled_saved_adapters(trained, qwen3):
    out, results = trained
    base = _hf_weights(qwen3.hf)
    adapters = _peft_adapters(out / "ckpt")
    assert len(adapters) == 2 * 7  # q k v o gate up down, per layer
    for result in results:
        for name, tensor in result["before"].items():
            assert torch.equal(tensor, base[name]), name  # B starts at zero: the base itself
        for module, (a, b) in adapters.items():
            w = base[f"{module}.weight"]
            expected = w.float() + (b.float() @ a.float()) * SCALING
            got = result["after"][f"{module}.weight"]
            assert not torch.equal(got, w), module
            assert torch.allclose(got, expected, rtol=1e-6, atol=1e-7), module
        untouched = [n for n in result["after"] if n.removesuffix(".weight") not in adapters]
        assert untouched
        for name in untouched:
            assert torch.equal(result["after"][name], base[name]), name


def test_the_peft_copy_merges_in_peft_to_the_engine_weights(trained, qwen3):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, results = trained
    model = AutoModelForCausalLM.from_pretrained(str(qwen3.hf), dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(out / "ckpt" / "adapter")).merge_and_unload().state_dict()
    for name, tensor in results[0]["after"].items():
        assert torch.allclose(merged[name], tensor, rtol=1e-6, atol=1e-7), name


def test_the_checkpoint_holds_only_adapters_and_restores_them(trained):
    from megatron.core import dist_checkpointing

    out, results = trained
    keys = dist_checkpointing.load_tensors_metadata(str(out / "ckpt")).keys()
    model_keys = [k for k in keys if not k.startswith("optimizer.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:5]
    for result in results:
        for name, tensor in result["after"].items():
            assert torch.equal(result["loaded"][name], tensor), name


def _loss(backend: str, nproc: int, qwen3, ckpt: Path, out: Path) -> tuple[float, torch.Tensor]:
    succeeded(launch(WORKER, "loss", backend, qwen3.hf, qwen3.torch_dist, ckpt, out, nproc=nproc))
    found = torch.load(out / "loss.pt")
    return float(found["loss"]), found["logprobs"]


def test_first_step_loss_at_tp2_equals_tp1_and_the_fsdp_path(trained, qwen3, tmp_path):
    out, results = trained
    # TP2 + SP, the trained adapters loaded from the checkpoint
    tp2, tp2_logp = results[0]["loaded_loss"], results[0]["loaded_logprobs"]
    (tmp_path / "tp1").mkdir()
    (tmp_path / "fsdp").mkdir()
    tp1, tp1_logp = _loss("megatron", 1, qwen3, out / "ckpt", tmp_path / "tp1")
    fsdp, fsdp_logp = _loss("fsdp", 1, qwen3, out / "ckpt", tmp_path / "fsdp")
    print(f"first-step loss: tp2+sp {tp2!r}, tp1 {tp1!r}, fsdp {fsdp!r}")
    # the adapters move the policy: its logprobs are not the base's (the loss depends on them)
    assert not torch.allclose(tp2_logp, results[0]["base_logprobs"], atol=1e-3)
    assert tp1 == pytest.approx(tp2, rel=1e-5, abs=0)
    assert fsdp == pytest.approx(tp2, rel=1e-5, abs=0)
    assert torch.allclose(tp1_logp, tp2_logp, rtol=1e-5, atol=1e-5)
    assert torch.allclose(fsdp_logp, tp2_logp, rtol=1e-5, atol=1e-5)


def test_the_recipe_trains_with_adapters_on_megatron_and_checkpoints_them(tmp_path):
    """The tiny recipe's own command on --train-backend megatron with --lora-rank: its --ci-test
    checks hold after every weight sync (the engine's weights equal the trainer's merged ones), and
    the checkpoint holds the adapters, their PEFT copy beside them."""
    from megatron.core import dist_checkpointing

    from tests.support import recipes as runs

    plan = runs.tiny_plan(
        "qwen3_4b", tmp_path, "--lora-rank", "4", "--lora-alpha", "8", "--num-rollout", "2", "--save-interval", "2",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
        train_backend="megatron",
    )  # fmt: skip
    assert "--ci-test" in plan.train_args and "megatron" in plan.train_args
    assert runs.launch(plan, tmp_path / "record") == 0
    assert sorted(runs.series(tmp_path / "record", "train/grad_norm")) == [0, 1]
    saved = runs.checkpoint_dir(plan) / "iter_0000002"
    assert {p.name for p in (saved / "adapter").iterdir()} == {
        "adapter_model.safetensors",
        "adapter_config.json",
    }
    keys = [k for k in dist_checkpointing.load_tensors_metadata(str(saved)) if not k.startswith("optimizer.")]
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), keys[:5]
