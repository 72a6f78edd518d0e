"""MTP-only training on the Megatron backend, then speculative rollouts that accept its drafts.

A 2-layer GLM-5.2 tiny (its MTP layer, `model.layers.2.*`, indexes for itself) trains with
megatron-core on one gloo rank, --enable-mtp-training --mtp-only-training: every rollout of the
echo prompts (12 tokens each, sampled at temperature 0.01 from weights of std 0.2, so the
policy's next token is nearly fixed, as a trained policy's is, and a drafter can learn it) is
drafted by the checkpoint's MTP layer in the built-in engine (--sglang-speculative-algorithm
EAGLE, one draft a step) and verified by the policy. The MTP loss
falls, the acceptance rate of the engine's drafts climbs past 0.6 once the trained MTP layer is
pushed to the engine, and every weight outside the MTP layer is bit-identical to the starting
checkpoint's after the steps while the MTP layer's moved. Without --mtp-only-training the RL loss
moves the policy beside them (two ranks at TP 2), and at PP 2, where the MTP layer on the last
stage reads the first stage's word embedding, every rollout's MTP loss and gradient norm equal
TP 2's; a built-in engine that does not draft cannot take trained MTP layers, which is refused at
start. Qwen3.5's MTP block (mtp.*, beside gated delta nets) trains alone and its drafts are taken, and
so does MiMo's (model.mtp_layers.0.*: its input_proj takes [hidden; token], its trunk loads as
transformers' Qwen2ForCausalLM) and DeepSeek-V4's (mtp.0.*, trained by miles' own model on the
policy's hyper-connection streams).
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
from tests.support import recipes as runs

register_cpu_ci(est_time=72, suite="stage-b-cpu")

ROOT = Path(__file__).resolve().parents[2]
ROLLOUTS = 8
FLAGS = (
    "--prompt-data", "synthetic:echo", "--input-key", "prompt", "--label-key", "label", "--rm-type", "synthetic",
    "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
    "--rollout-max-response-len", "12", "--rollout-temperature", "0.01", "--global-batch-size", "4",
    "--micro-batch-size", "4", "--advantage-estimator", "grpo", "--optimizer", "adam", "--lr", "3e-2",
    "--weight-decay", "0.1", "--rollout-engine", "torch", "--train-backend", "megatron",
    "--tensor-model-parallel-size", "1", "--distributed-backend", "gloo", "--num-threads", "1", "--seed", "7",
    "--enable-mtp-training", "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "1.0", "--ci-test",
)  # fmt: skip
SPECULATE = (
    "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "1",
    "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "2",
)  # fmt: skip


def tiny_checkpoint(workdir: Path, family: str = "glm_moe_dsa", layers: int = 2) -> tuple[Path, Path]:
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.ckpt.torch_dist import convert_to_torch_dist

    # weights drawn with std 0.2 (transformers' default 0.02 leaves a tiny model's next token
    # near-uniform at any temperature): its samples at 0.01 are then those a trained policy gives
    hf = make_tiny_checkpoint(
        family, layers, workdir / f"{family}{layers}", dtype="float32", progress=False, initializer_range=0.2
    )
    dist = workdir / f"{family}{layers}_torch_dist"
    dist.mkdir()
    convert_to_torch_dist(hf, dist, family)
    return hf, dist


def read_torch_dist(directory: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a torch_dist directory (the release or an iteration's)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(directory))
    meta = reader.read_metadata().state_dict_metadata
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in meta.items()
        if isinstance(v, TensorStorageMetadata) and not k.startswith("optimizer")
    }
    load(state, storage_reader=reader, no_dist=True)
    return state


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("glm"))


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    # 4 layers: three gated delta nets and the full-attention layer the MTP layer is built like
    return tiny_checkpoint(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5_moe", 4)


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("mimo"), "mimo")


@pytest.fixture(scope="module")
def deepseek_v4(tmp_path_factory):
    # 4 layers: sliding, sliding, CSA, HCA and hash routing on the first three, as published
    return tiny_checkpoint(tmp_path_factory.mktemp("deepseek_v4"), "deepseek_v4", 4)


def train(
    glm, workdir: Path, rollouts: int, *flags: str, ranks: int = 1
) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """`miles.train` on `ranks` gloo ranks from the tiny GLM, saving at its last rollout: (the process,
    its --save dir, its metric record)."""
    hf, dist = glm
    save, record = workdir / "ckpt", workdir / "record"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "miles.train",
        "--hf-checkpoint", str(hf), "--ref-load", str(dist), "--save", str(save), *FLAGS,
        "--num-rollout", str(rollouts), "--save-interval", str(rollouts), *flags,
    ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MILES_CI_GATE_RECORD_DIR": str(record),
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    return proc, save, record


def trunk_and_mtp(glm, save: Path) -> tuple[list[str], list[str]]:
    """(trunk weights, MTP weights) whose saved values differ from the starting checkpoint's."""
    before = read_torch_dist(next(glm[1].glob("release")))
    after = read_torch_dist(next(save.glob("iter_*")))
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert any(not k.startswith("mtp.") for k in before)
    return [k for k in moved if not k.startswith("mtp.")], [k for k in moved if k.startswith("mtp.")]


def mtp_only(checkpoint, workdir: Path, rollouts: int) -> tuple[dict, dict, Path]:
    """MTP-only training with speculative rollouts: (acceptance by rollout, MTP loss by rollout, --save)."""
    proc, save, record = train(checkpoint, workdir, rollouts, "--mtp-only-training", *SPECULATE)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    accept = runs.series(record, "rollout/spec_accept_rate")
    mtp = runs.series(record, "train/mtp_loss")
    print("acceptance by rollout:", json.dumps({k: round(v, 3) for k, v in accept.items()}))
    print("mtp loss by rollout:", json.dumps({k: round(v, 3) for k, v in mtp.items()}))
    assert sorted(accept) == list(range(rollouts)) and sorted(mtp) == list(range(rollouts))
    return accept, mtp, save


def test_mtp_only_training_makes_speculative_rollouts_accept_and_leaves_the_policy_bit_identical(
    glm, tmp_path
):
    accept, mtp, save = mtp_only(glm, tmp_path, ROLLOUTS)
    assert mtp[ROLLOUTS - 1] < 0.5 * mtp[0], mtp
    assert accept[0] < 0.5, accept  # the checkpoint's random MTP layer drafts what the policy rarely samples
    last = sum(accept[s] for s in range(ROLLOUTS - 3, ROLLOUTS)) / 3
    assert last >= 0.6, accept
    trunk, mtp_moved = trunk_and_mtp(glm, save)
    assert trunk == [], trunk[:5]
    assert mtp_moved, "no MTP weight changed"


TWO_RANKS = ("--actor-num-gpus-per-node", "2")
# sampled at temperature 1 the groups' rewards differ, so the RL loss moves the word embedding row
# by row (weight decay alone only scales it, which the MTP layer's embedding norm hides); Adam at a
# small rate without decay keeps two layouts' float rounding from growing into different weights
MOVING = ("--rollout-temperature", "1.0", "--lr", "1e-3", "--weight-decay", "0")


@pytest.fixture(scope="module")
def beside_rl(glm, tmp_path_factory):
    """Two rollouts of MTP training beside the RL loss on two ranks at TP 2 (with sequence
    parallelism, as MoE needs): (the process, --save, record)."""
    tp2 = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
    return train(glm, tmp_path_factory.mktemp("beside_rl"), 2, *SPECULATE, *MOVING, *TWO_RANKS, *tp2, ranks=2)


def test_mtp_training_beside_the_rl_loss_lets_the_rl_loss_train_the_policy(glm, beside_rl):
    proc, save, record = beside_rl
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert sorted(runs.series(record, "train/mtp_loss")) == [0, 1]
    assert runs.series(record, "rollout/zero_std_groups")[0] < 1.0  # the RL loss had something to learn
    trunk, mtp_moved = trunk_and_mtp(glm, save)
    assert trunk and mtp_moved


def test_mtp_training_on_two_pipeline_stages_equals_tensor_parallel(glm, beside_rl, tmp_path):
    """At PP 2 the MTP layer sits on the last stage, the word embedding it reads on the first, which
    the RL loss moves every step: the last stage takes the first's embedding before each step, and
    the MTP loss and the gradient norm of every rollout are those of the same two ranks at TP 2,
    where one rank holds both (a stale embedding moves them from the second step on)."""
    _, _, one = beside_rl
    proc, save, record = train(
        glm, tmp_path, 2, *SPECULATE, *MOVING, *TWO_RANKS, "--pipeline-model-parallel-size", "2", ranks=2
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    for key in ("train/mtp_loss", "train/grad_norm", "rollout/raw_reward"):
        want, got = runs.series(one, key), runs.series(record, key)
        print(key, want, got)
        assert sorted(got) == [0, 1], (key, got)
        for step in (0, 1):
            # measured: 7e-8 relative (grad norm); without the embedding sent each step 2e-5 to 1.4e-4
            assert abs(got[step] - want[step]) <= 1e-5 * max(1.0, abs(want[step])), (key, step, want, got)
    trunk, mtp_moved = trunk_and_mtp(glm, save)
    assert trunk and mtp_moved


def test_mtp_layers_trained_for_a_built_in_engine_that_does_not_draft_are_refused(glm, tmp_path):
    proc, _, _ = train(glm, tmp_path, 1)
    assert proc.returncode != 0
    assert "--enable-mtp-training: the torch rollout engine holds no MTP layers" in proc.stdout + proc.stderr


def test_qwen3_5s_mtp_block_trains_alone_and_its_drafts_are_taken_by_the_engine(qwen3_5, tmp_path):
    """Qwen3.5 keeps its MTP layer as mtp.* (mtp.fc, its norms, mtp.layers.0.*): the trainer trains
    it alone, hands it to the built-in engine's drafter under those names each rollout (a name the
    drafter does not hold fails the weight update), and the policy stays bit-identical."""
    # measured: mtp loss 7.14 -> 0.95, acceptance 0.0 -> 0.79 over 4 rollouts
    assert_mtp_alone_learns_to_draft(qwen3_5, tmp_path, 4)


def test_mimos_mtp_layer_trains_alone_and_its_drafts_are_taken_by_the_engine(mimo, tmp_path):
    """MiMo keeps its MTP layer as model.mtp_layers.0.* (input_proj of [hidden; token], its norms, a
    Qwen2 decoder layer): the trainer trains it alone as megatron-core's MTP block (eh_proj holding
    input_proj's halves swapped), hands it to the built-in engine's drafter under the checkpoint's
    names each rollout (input_proj back in MiMo's order: a drafter reading the halves the other way
    would not learn to draft), and the Qwen2 trunk stays bit-identical."""
    assert_mtp_alone_learns_to_draft(mimo, tmp_path, ROLLOUTS)


def test_deepseek_v4s_mtp_layer_trains_alone_and_its_drafts_are_taken_by_the_engine(deepseek_v4, tmp_path):
    """DeepSeek-V4 keeps its MTP layer as mtp.0.* (e_proj, h_proj, its norms and hc_head beside a
    decoder layer on hyper-connection streams): miles' own model trains it alone
    (Model.train_mtp), the trainer hands it to the built-in engine's drafter under the
    checkpoint's names each rollout, and the trunk stays bit-identical."""
    assert_mtp_alone_learns_to_draft(deepseek_v4, tmp_path, ROLLOUTS, projection="mtp.layers.0.h_proj")


def assert_mtp_alone_learns_to_draft(
    checkpoint, tmp_path, rollouts: int, projection: str = "mtp.layers.0.eh_proj"
) -> None:
    """MTP-only training of `checkpoint`: the MTP loss halves, the drafts go from mostly rejected
    to accepted at 0.6 or more, the trunk stays bit-identical and the MTP projection moves."""
    accept, mtp, save = mtp_only(checkpoint, tmp_path, rollouts)
    assert mtp[rollouts - 1] < 0.5 * mtp[0], mtp
    assert accept[0] < 0.5 and accept[rollouts - 1] >= 0.6, accept
    trunk, mtp_moved = trunk_and_mtp(checkpoint, save)
    assert trunk == [], trunk[:5]
    assert any(k.startswith(projection) for k in mtp_moved), mtp_moved
