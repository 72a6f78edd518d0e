"""Qwen2 (Qwen2.5-0.5B's family) built by megatron-core computes what transformers' Qwen2ForCausalLM computes.

A tiny random Qwen2 checkpoint (the family's tiny profile: tied embeddings, GQA with 4 query
heads per KV head, q/k/v biases and norms seeded away from transformers' 0 and 1) is converted
to torch_dist by the converter prepare-ckpt runs and loaded into megatron-core's GPTModel on CPU:
float32 logits at most 1e-5 from the HF model's on one rank, and on two gloo ranks at TP 2 with
sequence parallelism and at PP 2 (the weights cut from the checkpoint through the family's
mapping, tests/megatron/layout_logits_worker.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.ci.register import register_cpu_ci
from tests.support.ckpt import tiny as cached

register_cpu_ci(est_time=15, suite="stage-b-cpu")

TOL = 1e-5
LAYERS = 2
WORKER = Path(__file__).with_name("layout_logits_worker.py")


@pytest.fixture(scope="module")
def made():
    """The tiny checkpoint and its torch_dist form, from the lane run's cache (tests.support.ckpt)."""
    return cached("qwen2", LAYERS, dtype="float32", torch_dist=True)


@pytest.fixture(scope="module")
def tiny(made):
    return made.hf


def test_the_tiny_checkpoint_has_the_published_switches(tiny):
    from safetensors import safe_open

    config = json.loads((tiny / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is True
    assert config["num_attention_heads"] // config["num_key_value_heads"] == 4
    biases = {}
    for shard in tiny.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            biases |= {k: f.get_tensor(k) for k in f.keys() if k.endswith("proj.bias")}
    assert sorted({k.rsplit(".", 2)[-2] for k in biases}) == ["k_proj", "q_proj", "v_proj"]
    assert all(float(t.abs().max()) > 0 for t in biases.values())  # seeded, not transformers' zeros


def test_megatron_logits_match_hf_logits_on_one_rank(made):
    from miles.ckpt.torch_dist import RELEASE
    from miles.families.model import hf_logit_gap, load_model
    from miles.megatron.checkpoint import single_process_group
    from miles.megatron.compat import cpu_placed

    tiny, dst = made.hf, made.torch_dist  # converted with the converter's own check, compared here tighter
    config = json.loads((tiny / "config.json").read_text())
    with single_process_group(), torch.random.fork_rng(devices=[]), cpu_placed():
        model = load_model(config, dst / RELEASE, dtype=torch.float32)
        assert "linear_qkv.bias" in " ".join(model.state_dict())
        gap = hf_logit_gap(tiny, model, config)
    assert gap <= TOL, f"megatron and HF logits differ by up to {gap:.3g}"


def test_megatron_logits_match_hf_logits_at_tp2_with_sp_and_at_pp2(tiny):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WORKER), str(tiny), "tp2sp", "pp2"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
    gaps = {r["layout"]: r["gap"] for r in json.loads(lines[-1].removeprefix("RESULT "))}
    assert sorted(gaps) == ["pp2", "tp2sp"]
    assert all(gap <= TOL for gap in gaps.values()), gaps


def test_a_sliding_window_config_is_refused_by_name():
    from miles.families import UnmappedModel, family

    config = {"model_type": "qwen2", **family("qwen2").tiny_dims, "use_sliding_window": True}
    with pytest.raises(UnmappedModel, match="use_sliding_window=true"):
        family("qwen2").refuse_unmapped(config)
