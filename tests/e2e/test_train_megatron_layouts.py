"""Model-parallel layouts reproduce the data-parallel gradients, for every family Megatron builds.

Each family's tiny checkpoint trains 3 rollouts of the same samples with the FSDP backend and with
each layout below, all in one launch of two gloo ranks (tests/support/trainer_cases.py: the
trainer's own loop, command after command, megatron-core's parallel state rebuilt per layout);
each layout's gradient norms must be the FSDP run's: Qwen3 at TP=2 with SP, CP=2, PP=2 and PP=2
with two virtual stages each (the pipeline layouts through megatron's real schedules); GLM-5.2 at
TP=2 with SP and EP=2, and PP=2; Inkling at TP=2 with SP and EP=2, EP=2, and PP=2; DeepSeek-V4 at
TP=2 with SP and EP=2, PP=2 and PP=2 with two virtual stages each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import recipes as runs
from tests.support.ckpt import tiny
from tests.support.inkling import perturbed_checkpoint
from tests.support.trainer_cases import run_cases

register_cpu_ci(est_time=45, suite="stage-b-cpu")


# --- model-parallel layouts against data parallel ----------------------------------------
# Every layout below and each family's FSDP run train the same 3 rollouts of the same samples in one
# launch of two ranks (tests/support/trainer_cases.py: the trainer's own loop, command after
# command); each layout's gradient norms must be the FSDP run's.
BASE = (
    "--prompt-data", "synthetic:fixed", "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt",
    "4", "--global-batch-size", "16", "--micro-batch-size", "4", "--rollout-max-response-len", "8", "--lr", "1e-3",
    "--ci-test", "--num-threads", "1", "--actor-num-gpus-per-node", "2",
)  # fmt: skip

# Qwen3 (4 layers): the pipeline layouts through megatron's real schedules.
LAYOUTS = {
    "tp2-sp": ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
    "cp2": ("--context-parallel-size", "2"),
    "pp2": ("--pipeline-model-parallel-size", "2"),
    "pp2-vpp2": ("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"),
}
# GLM-5.2: the tiny's 4 layers run the DSA indexer on layers 0-2 and reuse layer 2's top-k on layer
# 3, so PP=2 splits them 2 + 2 (each stage starts on an indexer). Its index_topk (64) covers every
# sequence here, as it covers both backends' padded lengths: the top-k of a row shorter than
# index_topk is the whole row, so padding cannot change it (the sparse path, where transformers'
# own top-k depends on the padded length through ties, is held to HF by test_megatron_glm.py).
GLM_LAYOUTS = {
    "tp2-sp-ep2": (
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
        "--expert-tensor-parallel-size", "1",
    ),
    "pp2": ("--pipeline-model-parallel-size", "2"),
}  # fmt: skip
# Inkling-Small: the tiny's 2 layers are a sliding-window dense layer and a global MoE layer; its
# norms, global scales, convolutions, relative-bias banks and expert bias are perturbed and its
# head scaled up first (at the initial values a missing sequence-parallel halo of the branch
# convolutions moves the gradient norms by less than 1e-4; on the perturbed checkpoint the run
# fails). PP=2 puts one layer on each stage. The norms agree to 1e-7 and are held to 1e-5.
INKLING_LAYOUTS = {
    "tp2-sp-ep2": GLM_LAYOUTS["tp2-sp-ep2"],
    "ep2": ("--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"),
    "pp2": ("--pipeline-model-parallel-size", "2"),
}
INKLING_REL = 1e-5
# DeepSeek-V4 (miles' own model, miles.families.deepseek_v4.model): the tiny's layers are sliding, sliding, CSA,
# HCA, so PP=2 splits them 2 + 2 and the 4 hyper-connection streams cross the stage boundary as
# [s, b*4, d]; the interleaved schedule (one layer per virtual stage) sizes its buffers from the
# streams too.
DSV4_LAYOUTS = {
    **GLM_LAYOUTS,
    "pp2-vpp2": ("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"),
}
FAMILY_LAYOUTS = {
    "qwen3": LAYOUTS,
    "glm_moe_dsa": GLM_LAYOUTS,
    "inkling": INKLING_LAYOUTS,
    "deepseek_v4": DSV4_LAYOUTS,
}


def _inkling_checkpoints(root: Path) -> tuple[Path, Path]:
    from miles.ckpt.torch_dist import convert_to_torch_dist

    hf = perturbed_checkpoint(root)
    dist = root / "torch_dist"
    dist.mkdir()
    convert_to_torch_dist(hf, dist, "inkling")
    return hf, dist


@pytest.fixture(scope="module")
def layout_norms(tmp_path_factory) -> dict[str, list[float]]:
    """Gradient norms by rollout of every "<family>/<layout>" case and each family's "<family>/fsdp"."""
    root = tmp_path_factory.mktemp("layouts")
    checkpoints = {
        family: tiny(family, 4, torch_dist=True) for family in ("qwen3", "glm_moe_dsa", "deepseek_v4")
    }
    checkpoints = {f: (c.hf, c.torch_dist) for f, c in checkpoints.items()}
    checkpoints["inkling"] = _inkling_checkpoints(root / "inkling")
    cases = {
        f"{f}/fsdp": [*BASE, "--hf-checkpoint", str(hf), "--train-backend", "fsdp"]
        for f, (hf, _) in checkpoints.items()
    }
    for family, layouts in FAMILY_LAYOUTS.items():
        hf, dist = checkpoints[family]
        for layout, flags in layouts.items():
            cases[f"{family}/{layout}"] = [
                *BASE, "--hf-checkpoint", str(hf), "--train-backend", "megatron", "--ref-load", str(dist), *flags
            ]  # fmt: skip
    records = run_cases(cases, root / "records")
    norms = {name: runs.series(folder, "train/grad_norm") for name, folder in records.items()}
    return {name: [n[s] for s in sorted(n)] for name, n in norms.items()}


def _parity(layout_norms: dict, family: str, layout: str) -> tuple[list[float], list[float], str]:
    fsdp, norms = layout_norms[f"{family}/fsdp"], layout_norms[f"{family}/{layout}"]
    assert len(norms) == len(fsdp) == 3, (family, layout, norms, fsdp)
    return norms, fsdp, json.dumps({"fsdp": fsdp, layout: norms})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_model_parallel_layouts_reproduce_the_data_parallel_gradients(layout_norms, layout):
    norms, fsdp, shown = _parity(layout_norms, "qwen3", layout)
    assert norms == pytest.approx(fsdp, rel=1e-4), shown


@pytest.mark.parametrize("layout", list(GLM_LAYOUTS))
def test_glm_model_parallel_layouts_reproduce_the_data_parallel_gradients(layout_norms, layout):
    norms, fsdp, shown = _parity(layout_norms, "glm_moe_dsa", layout)
    assert norms == pytest.approx(fsdp, rel=1e-4), shown


@pytest.mark.parametrize("layout", list(INKLING_LAYOUTS))
def test_inkling_model_parallel_layouts_reproduce_the_data_parallel_gradients(layout_norms, layout):
    norms, fsdp, shown = _parity(layout_norms, "inkling", layout)
    assert norms == pytest.approx(fsdp, rel=INKLING_REL), shown


@pytest.mark.parametrize("layout", list(DSV4_LAYOUTS))
def test_dsv4_model_parallel_layouts_reproduce_the_data_parallel_gradients(layout_norms, layout):
    norms, fsdp, shown = _parity(layout_norms, "deepseek_v4", layout)
    assert norms == pytest.approx(fsdp, rel=1e-4), shown
