"""The trainer checks the checkpoints it starts from before the first step, and says what is wrong in one line.

Qwen3-4B's tiny profile is prepared by prepare-ckpt (HF dir and torch_dist, each with its
manifest). A --ref-load overwritten in place (same size), and the torch_dist of another model
of the same shape (another seed, prepared the same way), used to train with exit 0; each is now
refused before any model loads, in one line naming the file, and said once on two ranks.
A layout error, which every rank finds alike, is also said once. Without manifests (a torch_dist converted elsewhere) the files are checked against their own
index and common.pt against config.json, and --ci-test compares what the rollout engine holds
with --hf-checkpoint's files, so a damaged --ref-load no longer passes a check that compared
the model with itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import ranks as support_ranks
from tests.support import recipes as runs

register_cpu_ci(est_time=15, suite="stage-b-cpu")


RUN = (
    "--prompt-data synthetic:fixed --rm-type synthetic --num-rollout 1 --rollout-batch-size 2 "
    "--n-samples-per-prompt 2 --rollout-max-response-len 4 --global-batch-size 4 --micro-batch-size 4 "
    "--rollout-engine torch --train-backend megatron --num-threads 1"
).split()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Path]:
    """(HF dir, torch_dist dir) of the recipe's tiny model, as prepare-ckpt leaves them."""
    plan = runs.tiny_plan("qwen3_4b", tmp_path_factory.mktemp("verified"))
    return Path(plan.checkpoint.hf_dir), Path(plan.checkpoint.torch_dist_dir)


def train(hf: Path, ref_load: Path, *extra: str, ranks: int = 1, logs: Path | None = None):
    launcher = support_ranks.torchrun(ranks) if ranks > 1 else [sys.executable]
    if logs is not None:  # each rank's own output in its own file: torchrun's --log-dir (it adds a summary of its own)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                    "--log-dir", str(logs), "--redirects", "3"]  # fmt: skip
    cmd = [
        *launcher, "-m", "miles.train", "--hf-checkpoint", str(hf),
        "--ref-load", str(ref_load), *RUN, "--actor-num-gpus-per-node", str(ranks), *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def miles_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("miles.train:")]


def overwrite_in_place(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\x41" * 256)
    assert path.stat().st_size == size


def test_a_ref_load_overwritten_in_place_is_refused_in_one_line_said_once(prepared, tmp_path):
    hf, dist = prepared
    damaged = tmp_path / "torch_dist"
    shutil.copytree(dist, damaged)
    overwrite_in_place(damaged / "release" / "__0_0.distcp")
    done = train(hf, damaged, ranks=2, logs=tmp_path / "logs")
    assert done.returncode != 0
    said = {p.parent.name: p.read_text() for p in (tmp_path / "logs").rglob("stderr.log")}
    assert sorted(said) == ["0", "1"], said
    assert said["1"] == ""  # the same verdict on both ranks, said by rank 0 only
    assert said["0"].splitlines() == [
        f"miles.train: CheckpointRefused: --ref-load {damaged}: {damaged / 'release' / '__0_0.distcp'} is not the "
        "file that was written: its sha256 differs from the recorded one (changed in place); rerun `invoke "
        "prepare-ckpt` for this model (it redoes a step whose files changed), or point --ref-load at an intact copy"
    ]


def test_another_models_torch_dist_of_the_same_shape_is_refused(prepared, tmp_path):
    from miles.ckpt.pipeline import prepare
    from miles.ckpt.plan import CheckpointPlan
    from miles.ckpt.tiny import make_tiny_checkpoint

    hf, _ = prepared
    other = make_tiny_checkpoint("qwen3", 2, tmp_path / "other-seed", seed=1, progress=False)
    plan = CheckpointPlan("qwen3", "Other", str(other), str(tmp_path / "models"), 2, ("fetch", "torch_dist"))
    prepare(plan, progress=False)
    done = train(hf, Path(plan.torch_dist_dir))
    assert done.returncode == 1, done.stdout[-2000:]
    assert "Traceback" not in done.stderr
    (line,) = miles_lines(done.stderr)
    assert line.startswith(
        f"miles.train: CheckpointRefused: --ref-load {plan.torch_dist_dir} was converted from another checkpoint "
        f"than --hf-checkpoint {hf}"
    ), line


def test_without_manifests_a_short_file_and_another_shape_are_named(prepared, tmp_path):
    """A torch_dist converted elsewhere has no manifest: its own index and common.pt are checked."""
    import argparse

    import torch

    from miles.train.args import parse_config
    from miles.train.inputs import checkpoint_problems

    hf, dist = prepared
    bare = tmp_path / "torch_dist"
    shutil.copytree(dist, bare)
    (bare / ".miles-ckpt.json").unlink()
    args = ["--hf-checkpoint", str(hf), "--ref-load", str(bare), *RUN]
    common = torch.load(bare / "release" / "common.pt", weights_only=False)
    common["args"] = argparse.Namespace(**{**vars(common["args"]), "num_layers": 3})
    torch.save(common, bare / "release" / "common.pt")
    assert checkpoint_problems(parse_config(args)) == [
        f"--ref-load {bare}: {bare / 'release' / 'common.pt'} records another model than {hf / 'config.json'}: "
        f"num_layers 3 (config.json: 2); convert --hf-checkpoint {hf} with `invoke prepare-ckpt` and pass its "
        "_torch_dist as --ref-load"
    ]
    data = bare / "release" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    (problem,) = checkpoint_problems(parse_config(args))
    assert problem.startswith(f"--ref-load {bare}: {data} is 1000 bytes, but its tensors end at byte ")


def test_the_ci_weight_check_compares_the_engine_with_the_hf_checkpoint(prepared, tmp_path):
    """A damaged torch_dist without a manifest loads into trainer and engine alike; the engine's
    weights are then compared with --hf-checkpoint's files, not with the trainer's."""
    hf, dist = prepared
    damaged = tmp_path / "torch_dist"
    shutil.copytree(dist, damaged)
    (damaged / ".miles-ckpt.json").unlink()
    overwrite_in_place(damaged / "release" / "__0_0.distcp")
    done = train(hf, damaged, "--ci-test")
    assert done.returncode == 1, done.stdout[-2000:]
    (line,) = miles_lines(done.stderr)
    assert line.startswith(
        "miles.train: NotTheCheckpoint: the torch rollout engine's weights are not the HF checkpoint the run "
        f"names (--hf-checkpoint {hf}) in 1 of "
    ), line


def test_a_layout_error_every_rank_finds_is_said_once(tmp_path):
    """Each rank of a two-rank job parses the command; the layout error comes before any
    rendezvous, so the ranks are started here with the variables torchrun gives them (under
    torchrun, whichever rank fails first gets the others killed, which hides the repeat)."""
    cmd = [
        sys.executable, "-m", "miles.train", "--hf-checkpoint", str(tmp_path), "--train-backend", "megatron",
        "--tensor-model-parallel-size", "3", "--actor-num-gpus-per-node", "2",
    ]  # fmt: skip
    said = {}
    for rank in (0, 1):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
        }
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 2
        said[rank] = done.stderr
    assert said[1] == ""
    assert said[0].splitlines()[0].startswith("python -m miles.train: error: miles.train: tp3"), said[0]
    assert "does not divide world size 2" in said[0]
