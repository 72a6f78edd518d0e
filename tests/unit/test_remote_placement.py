"""Placement flags: which run puts its rollout engines in processes of their own, what such a run
acts on and refuses, the transfer it builds, and the checksum check of the engines' weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.train import consumption
from miles.train.args import parse_config
from miles.train.checks import CheckFailed, check_weight_checksums
from miles.train.remote.checksums import tensor_checksum
from miles.train.rollout import RolloutEngineError

register_cpu_ci(est_time=6, suite="stage-a-cpu")

HERE = Path(__file__).parent


def _config(*flags: str):
    return parse_config(["--hf-checkpoint", "m", *flags])


def test_rollout_gpus_without_colocate_place_the_engines_in_processes_of_their_own():
    assert consumption.disaggregated(_config("--rollout-num-gpus", "2"))
    assert not consumption.disaggregated(_config("--rollout-num-gpus", "2", "--colocate"))
    assert not consumption.disaggregated(_config())


@pytest.mark.parametrize("engine", ["torch", "sglang"])
def test_a_disaggregated_run_acts_on_its_transfer_flags(engine):
    config = _config(
        "--rollout-num-gpus", "2", "--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "d",
        "--update-weight-local-checkpoint-dir", "l", "--update-weight-delta-encoding", "overwrite",
        "--pause-generation-mode", "in_place",
    )  # fmt: skip
    assert consumption.refusal(config, engine) is None


def test_transfer_flags_on_engines_in_the_trainers_processes_are_refused_naming_who_reads_them():
    refused = consumption.refusal(_config("--update-weight-transfer-mode", "disk"), "torch")
    assert refused.startswith(
        "--update-weight-transfer-mode (read by the torch/sglang rollout engines in processes of their own "
        "(--rollout-num-gpus)): no effect on --train-backend fsdp with the torch rollout engine"
    )


def test_rollout_gpus_with_colocate_is_refused_with_the_reason():
    refused = consumption.refusal(_config("--rollout-num-gpus", "2", "--colocate"), "sglang")
    assert "--rollout-num-gpus (with --colocate the rollout shares the training devices" in refused


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--update-weight-transfer-mode", "disk"), "disk needs --update-weight-disk-dir"),
        (
            ("--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "d"),
            "disk-delta needs --update-weight-local-checkpoint-dir",
        ),
        (
            (
                "--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "d",
                "--update-weight-local-checkpoint-dir", "l", "--update-weight-delta-checksum", "blake3",
            ),
            "blake3 needs the blake3 package",
        ),
    ],
)  # fmt: skip
def test_a_disk_transfer_missing_what_it_needs_is_one_line(flags, message):
    from miles.train.remote.checksums import missing_package
    from miles.train.remote.engine import make_transfer

    if "blake3" in flags and missing_package("blake3") is None:
        pytest.skip("blake3 is installed here")
    config = _config("--rollout-num-gpus", "1", *flags)
    with pytest.raises(RolloutEngineError, match=message):
        make_transfer(config.engines, config.sglang, backend="gloo", address="127.0.0.1")


def test_the_checksum_of_a_tensor_is_sglangs_weight_checksum():
    # sglang 0.5.23 managers/mm_utils.py tensor_hash (CPU): sha256 of the bytes, first 8, big-endian
    import hashlib

    t = torch.arange(6, dtype=torch.float32)
    expected = int.from_bytes(hashlib.sha256(t.numpy().tobytes()).digest()[:8], "big")
    assert tensor_checksum(t) == f"{expected:016x}"


def test_engine_checksums_equal_to_the_trainers_pass_and_one_flipped_bit_fails():
    weights = {"a": torch.randn(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}
    sums = {n: tensor_checksum(t) for n, t in weights.items()}
    assert check_weight_checksums(2, {"engine-0": sums, "engine-1": sums}, weights) == 4
    flipped = weights["a"].clone()
    flipped.view(torch.int32)[1, 2] ^= 1
    with pytest.raises(
        CheckFailed, match="rollout 2: .* rollout engine engine-1 differs .* in 1 tensor.*: a"
    ):
        check_weight_checksums(
            2, {"engine-0": sums, "engine-1": {**sums, "a": tensor_checksum(flipped)}}, weights
        )
    with pytest.raises(CheckFailed, match="engine-0 lacks trainer weight b"):
        check_weight_checksums(2, {"engine-0": {"a": sums["a"]}}, weights)
    assert check_weight_checksums(2, {"engine-0": {"a": sums["a"]}}, weights, skip_list=["b"]) == 1


def test_sglang_servers_get_the_sglang_flags_as_launch_server_flags():
    """Against the pinned sglang's ServerArgs (imported with its GPU packages stood in)."""
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import sglang_imports; sglang_imports.install(); "
        "import json; from miles.train.args import parse_config; from miles.train.remote.sglang import "
        "server_cli_args; from miles.train.rollout import RolloutEngineError\n"
        "c = parse_config(['--hf-checkpoint', 'm', '--sglang-mem-fraction-static', '0.7', "
        "'--sglang-enable-metrics', '--sglang-cuda-graph-bs-decode', '1', '2', '--sglang-max-running-requests', '512'])\n"
        "print(json.dumps(server_cli_args(c.sglang)))\n"
        "try:\n    server_cli_args(parse_config(['--hf-checkpoint', 'm', '--sglang-no-such-thing', '1']).sglang)\n"
        "except RolloutEngineError as exc:\n    print(exc)\n"
    )
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed: pip install --no-deps -r requirements/cpu-sglang.txt")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert json.loads(out[0]) == [
        "--log-level", "error", "--mem-fraction-static", "0.7", "--enable-metrics", "--cuda-graph-bs-decode", "1", "2",
        "--max-running-requests", "512",
    ]  # fmt: skip
    assert out[1] == "--sglang-no-such-thing: this SGLang has no server argument 'no_such_thing'"
