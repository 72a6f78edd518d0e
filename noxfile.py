"""Lanes CI calls, generated from miles/ci/catalog.toml, plus the test and lint sessions.

`nox -l` lists them; `nox -s cpu` is the main job, `nox -s tests` the test command.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox
import nox.command

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from miles.ci.machine.preflight import python_available, split_lane_args  # noqa: E402
from miles.ci.machine.stacks import stack_for_lane  # noqa: E402
from miles.ci.registry.catalog import load_catalog  # noqa: E402
from miles.image.install import install_arguments, torch_source_warning  # noqa: E402
from miles.image.pins import parse_lock  # noqa: E402

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["cpu"]
# A lane whose Python is missing must fail, not be skipped with a green exit code.
nox.options.error_on_missing_interpreters = True

CATALOG = load_catalog()
# `nox -s <lane> -- --plan` needs only the standard-library core, so a plan runs on the
# interpreter nox itself runs on: a laptop without the lane's Python still gets its plan.
PLANNING = "--plan" in sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else False


# The interpreter of the CI image, for `-- --system`: found before nox puts a venv on PATH.
SYSTEM_PYTHON = os.environ.get("MILES_SYSTEM_PYTHON") or shutil.which("python3") or sys.executable


# The GPU lanes' sglang, without its GPU dependencies, so the cpu stack tests the SGLang
# adapter against the real package (see the file's header).
CPU_SGLANG = "requirements/cpu-sglang.txt"
# Tests that would skip without sglang fail instead where the stack above is installed.
REQUIRE_SGLANG = {"MILES_REQUIRE_SGLANG": "1"}


def install_lane_stack(session: nox.Session, lane: str) -> None:
    """Install the lane's pinned stack (requirements/<stack>.txt) and miles itself into the session."""
    stack = stack_for_lane(lane)
    warning = torch_source_warning(stack, ROOT, os.environ)
    if warning:
        session.warn(warning)
    session.install(*install_arguments(stack, ROOT, venv_backend=session.venv_backend, env=os.environ))
    if stack.backend == "cpu":
        session.install("--no-deps", "-r", str(ROOT / CPU_SGLANG))
    session.install("--no-deps", "-e", str(ROOT))


def gpu_lane_transformers() -> list[str]:
    """transformers versions the GPU lanes pin that the cpu lane does not (sglang pins its own)."""
    pinned = {
        lane.name: parse_lock(ROOT / stack_for_lane(lane.name).lock_path).pins["transformers"].version
        for lane in CATALOG.lanes.values()
    }
    cpu = {v for name, v in pinned.items() if CATALOG.lanes[name].backend == "cpu"}
    return sorted(set(pinned.values()) - cpu)


@nox.session(python=CATALOG.lanes["cpu"].python)
def tests(session: nox.Session) -> None:
    """Run the test suite: unit tests and every CPU-registered test (GPU-only ones skip)."""
    install_lane_stack(session, "cpu")
    # a worker per core, each test file whole on one worker (its module fixtures built once), each
    # worker one OpenMP thread (its share of the cores; miles.ci.running.plan.thread_share)
    default = ["-n", "auto", "--dist", "loadfile", "--durations", "30", "tests"]
    threads = {} if session.posargs or "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}
    session.run("pytest", *(session.posargs or default), env={**REQUIRE_SGLANG, **threads})


@nox.session(name="rollout-transformers", python=CATALOG.lanes["cpu"].python, default=False)
@nox.parametrize("transformers", gpu_lane_transformers())
def rollout_transformers(session: nox.Session, transformers: str) -> None:
    """Rollout engine vs a full forward, every family, under each GPU lane's pinned transformers."""
    install_lane_stack(session, "cpu")
    session.install(f"transformers=={transformers}")
    session.run(
        "pytest",
        "tests/unit/test_train_rollout_parity.py",
        "tests/unit/test_train_rollout.py",
        *session.posargs,
    )


@nox.session(python=CATALOG.lanes["cpu"].python, default=False)
def lint(session: nox.Session) -> None:
    """Check style with ruff and the CI registrations with the strict audit."""
    session.install("ruff")
    session.install("--no-deps", "-e", str(ROOT))
    session.run("ruff", "check", ".")
    session.run("python", "-m", "miles.ci", "audit", "--strict")


def run_keeping_exit_code(session: nox.Session, *args: str, **kwargs) -> None:
    """session.run, except that the runner's 2 (bad input) and the preflight's 3 (machine not
    fit) end nox with that same code instead of nox's own 1, so CI can tell them apart."""
    try:
        session.run(*args, **kwargs)
    except nox.command.CommandFailed as exc:
        if exc.return_code in (2, 3):
            raise SystemExit(exc.return_code) from None
        raise


def _make_lane(lane_name: str):
    lane = CATALOG.lanes[lane_name]
    suites = ", ".join(s.name for s in CATALOG.suites_of_lane(lane_name))

    def lane_session(session: nox.Session) -> None:
        args = split_lane_args(session.posargs)
        run = ["-m", "miles.ci", "run", "--lane", lane_name, *args.runner]
        if args.plan:
            # Planning needs only the standard-library core, so it works on any machine.
            if session.venv_backend != "none":
                session.install("--no-deps", "-e", str(ROOT))
            run_keeping_exit_code(session, "python", *run)
            return
        preflight = ["-m", "miles.ci", "preflight", "--lane", lane_name]
        preflight += [f"--suite={s}" for s in args.suites] + (["--clean"] if args.clean else [])
        if args.system or session.venv_backend == "none":
            # Inside the CI image: verify the installed stack against the lock (with a diff), install nothing.
            python = "python" if session.venv_backend == "none" else SYSTEM_PYTHON
            run_keeping_exit_code(session, python, *preflight, external=True)
            run_keeping_exit_code(session, python, *run, external=True)
            return
        if lane.backend != "cpu":
            # Check the machine before downloading a GPU stack that could not run here anyway.
            session.install("--no-deps", "-e", str(ROOT))
            run_keeping_exit_code(session, "python", *preflight, "--machine-only")
        install_lane_stack(session, lane_name)
        if lane.backend != "cpu":
            run_keeping_exit_code(session, "python", *preflight)
        run_keeping_exit_code(session, "python", *run, env=REQUIRE_SGLANG if lane.backend == "cpu" else None)

    lane_session.__doc__ = f"{lane.description} Suites: {suites}."
    python = lane.python
    if PLANNING or (lane.backend != "cpu" and not python_available(lane.python)):
        # A plan needs no stack; a GPU lane whose Python is missing still reaches its
        # preflight, which names the missing interpreter beside every other missing thing.
        python = None
    return nox.session(name=lane_name, python=python, default=lane_name == "cpu")(lane_session)


for _lane in CATALOG.lanes:
    _make_lane(_lane)
