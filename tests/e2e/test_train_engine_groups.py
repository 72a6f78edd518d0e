"""Engine groups from a file, with fault tolerance, on the CPU: the qwen3_4b tiny recipe (FSDP
rendering, two trainer ranks) with `--sglang-config` naming an updatable model (two engine
processes that roll out) and a frozen one (one engine that keeps its checkpoint), and
`--use-fault-tolerance --ci-test`, under which the fleet kills one rollout engine (SIGKILL)
while the second rollout's requests are in flight.

The run goes on: the dead engine's requests are answered by the other engine, and --ci-test
holds every rollout to all its groups, each answered once (miles.train.checks
check_rollout_complete), every engine that takes weights to the trainer's after each sync
(checksums; the restarted one too, once it is back) and the frozen engine to its checkpoint.
Asserted here besides: the requests retried are exactly the second rollout's, and every
rollout was trained.

The CPU twin of the seed's tests/e2e/sglang_config/test_sglang_config.py,
test_sglang_config_mixed_offload.py and test_sglang_config_mixed_offload_ft.py, and of the fault
tolerance of tests/e2e/short/test_qwen2.5_0.5B_gsm8k_async_short.py.
"""

from __future__ import annotations

from miles.ci.register import register_cpu_ci
from tests.support import recipes as runs

register_cpu_ci(est_time=20, suite="stage-b-cpu")


ROLLOUTS = 4
GROUPS = """
sglang:
  - name: actor
    update_weights: true
    server_groups:
      - worker_type: regular
        num_gpus: 2
        num_gpus_per_engine: 1
  - name: ref
    update_weights: false
    server_groups:
      - worker_type: regular
        num_gpus: 1
        num_gpus_per_engine: 1
"""


def test_an_engine_dies_mid_rollout_and_the_run_loses_no_request(tmp_path):
    config = tmp_path / "sglang_config.yaml"
    config.write_text(GROUPS)
    plan = runs.tiny_plan(
        "qwen3_4b", tmp_path,
        "--num-rollout", str(ROLLOUTS), "--rollout-max-response-len", "6", "--lr", "1e-2",
        "--rollout-engine", "torch", "--rollout-num-gpus", "3", "--sglang-config", str(config),
        "--use-fault-tolerance", "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "20",
        "--rollout-health-check-first-wait", "0",
        train_backend="fsdp",
    )  # fmt: skip
    assert "--ci-test" in plan.train_args
    record = tmp_path / "record"
    assert runs.launch(plan, record) == 0, "the run with a dead engine failed (its output is above)"
    retries = runs.series(record, "rollout/engine_retries")
    args = list(plan.train_args)
    value = lambda flag: int(args[len(args) - 1 - args[::-1].index(flag) + 1])  # noqa: E731 (the last, winning one)
    samples = value("--rollout-batch-size") * value(
        "--n-samples-per-prompt"
    )  # split over the two actor engines
    assert sorted(retries) == list(range(ROLLOUTS))
    assert retries[1] == samples / 2 and all(retries[r] == 0 for r in retries if r != 1), retries
    assert sorted(runs.series(record, "train/loss")) == list(range(ROLLOUTS))
