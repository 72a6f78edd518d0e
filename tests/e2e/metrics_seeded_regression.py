"""The seeded-regression protocol for the metric gate, runnable as a script or from a test.

1. Five unchanged training runs (seeds 0-4) are gated as nightly runs: cold start, each one
   stored as trusted history.
2. Against that baseline, regular (PR) runs are gated without being stored: the learning
   rate x100, the rollout temperature 1.5, and three unchanged reruns (seeds 5-7).

Every run is its own process writing its metric record through miles.metrics.capture; the
gates are the five standard metrics declared with one line each in a test file that
discovery reads. `python tests/e2e/metrics_seeded_regression.py [--trainer miles]
[--fixed-seed 1234]` prints the table; the default trainer is the toy GRPO script next to
this file, `miles` runs `python -m miles.train` on a tiny Qwen3 (about half a minute per
run on CPU).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the project root on the path, as the tests have it
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from miles.ci.registry.catalog import load_catalog
from miles.ci.registry.discover import discover
from miles.metrics.capture import RECORD_DIR_ENV, STANDARD_METRICS
from miles.metrics.gate import ERROR, FAIL
from miles.metrics.gating import GateOutcome, GateRun, gate_attempt
from tests.support.ranks import torchrun

HERE = Path(__file__).resolve().parent
GATED_TEST = "tests/e2e/test_seeded_recipe.py"
SUITE = "stage-b-cpu"


@dataclass(frozen=True)
class Case:
    name: str
    seed: int
    lr_scale: float = 1.0
    temperature: float = 1.0
    baseline: bool = False


def make_cases(fixed_seed: int | None = None) -> tuple[Case, ...]:
    """Seeds 0-4 for the baseline and 5-7 for the reruns, or one seed for every run (the way
    a recipe test pins it; on CPU its unchanged reruns are then bit-identical)."""

    def seed(s: int) -> int:
        return s if fixed_seed is None else fixed_seed

    return (
        *(Case(f"baseline seed {seed(s)}", seed(s), baseline=True) for s in range(5)),
        Case("lr x100", seed(5), lr_scale=100.0),
        Case("temperature 1.5", seed(5), temperature=1.5),
        *(Case(f"rerun seed {seed(s)}", seed(s)) for s in (5, 6, 7)),
    )


CASES = make_cases()


@dataclass(frozen=True)
class Row:
    case: Case
    outcome: GateOutcome
    exit_code: int = 0  # of the training process; a crashed run is still gated on its record

    @property
    def failing(self) -> tuple[str, ...]:
        return tuple(v.metric for v in self.outcome.verdicts if v.status in (FAIL, ERROR))

    def value(self, metric: str) -> float:
        verdict = next(v for v in self.outcome.verdicts if v.metric == metric)
        return verdict.checks[0].value if verdict.checks else math.nan


Trainer = Callable[[Case, Path], int]  # trains one case into a record dir; the exit code


def write_gated_test(root: Path) -> None:
    """The test file whose one-line gate declarations the protocol applies."""
    path = root / GATED_TEST
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["from miles.ci.register import register_ci_gate, register_cpu_ci", ""]
    lines.append(f'register_cpu_ci(est_time=30, suite="{SUITE}")')
    lines += [f'register_ci_gate(metric_key="{metric}")' for metric in STANDARD_METRICS]
    path.write_text("\n".join(lines) + "\n")


def run_protocol(trainer: Trainer, workdir: Path, store_url: str, cases=CASES) -> list[Row]:
    write_gated_test(workdir)
    found = discover(workdir, catalog=load_catalog(), cache=False).raise_for_problems()
    gates = found.file(GATED_TEST).gates
    rows = []
    for index, case in enumerate(cases):
        records = workdir / "records" / f"{index:02d}-{case.name.replace(' ', '-')}"
        code = trainer(case, records)
        if code != 0 and case.baseline:
            raise RuntimeError(
                f"baseline training {case.name} failed (exit {code}); no baseline to gate against"
            )
        cadence = "nightly" if case.baseline else "regular"
        run = GateRun(GATED_TEST, "cpu", SUITE, "cpu", cadence, lane_enforces=True)
        outcome = gate_attempt(records, gates, run, write_baseline=code == 0, store_url=store_url)
        rows.append(Row(case, outcome, code))
    return rows


def format_table(rows: list[Row]) -> str:
    short = {m: m.split("/")[-1].replace("train_rollout_", "tr_") for m in STANDARD_METRICS}
    header = ["run", "exit", *(short[m] for m in STANDARD_METRICS), "verdict", "failing gates"]
    table = [header]
    for row in rows:
        trust = {True: "TRUSTED", False: "NOT TRUSTED", None: "UNDECIDED"}[row.outcome.trusted]
        if row.case.baseline:
            trust = f"{trust} (stored, cold start)"
        cells = [f"{row.value(m):.4g}" for m in STANDARD_METRICS]
        failing = ", ".join(short[m] for m in row.failing) or "-"
        table.append([row.case.name, str(row.exit_code), *cells, trust, failing])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return (
        "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table)
        + "\n"
    )


# -- trainers ---------------------------------------------------------------------------------


def toy_trainer() -> Trainer:
    """Each run in a forked child of a process that imported torch once (a real, separate
    process with its own record, without paying torch's import for every run)."""
    import torch

    from tests.e2e import metrics_toy_trainer as toy

    # Warm torch up once (kernels, allocator) so every child starts from a ready process.
    # Children train single-threaded, so a thread pool the parent may hold is never entered
    # after the fork. The warm-up logs nowhere and leaves the parent's thread count alone.
    threads = torch.get_num_threads()
    saved = os.environ.pop(RECORD_DIR_ENV, None)
    try:
        toy.train(toy.ToyConfig(steps=1))
    finally:
        torch.set_num_threads(threads)
        if saved is not None:
            os.environ[RECORD_DIR_ENV] = saved

    def train(case: Case, records: Path) -> int:
        config = toy.ToyConfig(
            seed=case.seed, lr=toy.ToyConfig.lr * case.lr_scale, temperature=case.temperature
        )
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.environ[RECORD_DIR_ENV] = str(records)
                toy.train(config)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)

    return train


MILES_FLAGS = [
    "--prompt-data", "synthetic:fixed", "--rm-type", "synthetic", "--rollout-engine", "torch",
    "--num-rollout", "16", "--rollout-batch-size", "4", "--n-samples-per-prompt", "8",
    "--global-batch-size", "16", "--micro-batch-size", "8", "--rollout-max-response-len", "6",
    "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    "--use-kl-loss", "--kl-loss-type", "low_var_kl", "--kl-loss-coef", "0.001",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--weight-decay", "0.0", "--train-backend", "fsdp",
]  # fmt: skip
MILES_LR = 1e-2


def miles_trainer(workdir: Path) -> Trainer:
    """`python -m miles.train` under torchrun (one rank) on a tiny random Qwen3."""
    from miles.ckpt.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint("qwen3", 2, workdir / "Qwen3-tiny", seed=0)

    def train(case: Case, records: Path) -> int:
        flags = [*MILES_FLAGS, "--seed", str(case.seed), "--lr", str(MILES_LR * case.lr_scale)]
        flags += ["--rollout-temperature", str(case.temperature)]
        launcher = torchrun(1)
        env = {**os.environ, RECORD_DIR_ENV: str(records), "OMP_NUM_THREADS": "1"}
        command = [*launcher, "-m", "miles.train", "--hf-checkpoint", str(model), *flags]
        result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=workdir, timeout=600)
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if "Error:" in line] or ["(no error line)"]
            print(
                f"{case.name}: miles.train exited {result.returncode}: {errors[-1].strip()}", file=sys.stderr
            )
        return result.returncode

    return train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=("toy", "miles"), default="toy")
    parser.add_argument("--fixed-seed", type=int, help="one seed for every run (default: seeds 0-7)")
    parser.add_argument("--workdir", type=Path, help="default: a fresh temporary directory")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="miles-seeded-"))
    trainer = toy_trainer() if args.trainer == "toy" else miles_trainer(workdir)
    cases = make_cases(args.fixed_seed)
    rows = run_protocol(trainer, workdir, f"sqlite:///{workdir / 'history.sqlite'}", cases)
    print(f"trainer: {args.trainer}; history: {workdir / 'history.sqlite'}")
    print(format_table(rows), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
