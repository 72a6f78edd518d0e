"""Lanes CI calls, generated from miles/ci/catalog.toml, plus the test and lint sessions.

`nox -l` lists them; `nox -s cpu` is the main job, `nox -s tests` the test command.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from miles.ci.catalog import load_catalog  # noqa: E402

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["cpu"]

CATALOG = load_catalog()


def install_lane_stack(session: nox.Session, lane: str) -> None:
    """Install requirements/<lane>.txt and miles itself into the session."""
    find_links = []
    if session.venv_backend == "uv" and os.environ.get("PIP_FIND_LINKS"):
        # uv does not read pip's configuration; the local torch build lives there.
        find_links = ["--find-links", os.environ["PIP_FIND_LINKS"]]
    session.install(*find_links, "-r", str(ROOT / "requirements" / f"{lane}.txt"))
    session.install("--no-deps", "-e", str(ROOT))


@nox.session(python=CATALOG.lanes["cpu"].python)
def tests(session: nox.Session) -> None:
    """Run the test suite: unit tests and every CPU-registered test (GPU-only ones skip)."""
    install_lane_stack(session, "cpu")
    session.run("pytest", *(session.posargs or ["tests"]))


@nox.session(python=CATALOG.lanes["cpu"].python, default=False)
def lint(session: nox.Session) -> None:
    """Check style with ruff and the CI registrations with the strict audit."""
    session.install("ruff")
    session.install("--no-deps", "-e", str(ROOT))
    session.run("ruff", "check", ".")
    session.run("python", "-m", "miles.ci", "audit", "--strict")


def _make_lane(lane_name: str):
    lane = CATALOG.lanes[lane_name]
    suites = ", ".join(s.name for s in CATALOG.suites_of_lane(lane_name))

    def lane_session(session: nox.Session) -> None:
        if "--plan" in session.posargs:
            # Planning needs only the standard-library core, so it works on any machine.
            session.install("--no-deps", "-e", str(ROOT))
        else:
            install_lane_stack(session, "cpu" if lane.backend == "cpu" else lane_name)
        session.run("python", "-m", "miles.ci", "run", "--lane", lane_name, *session.posargs)

    lane_session.__doc__ = f"{lane.description} Suites: {suites}."
    return nox.session(name=lane_name, python=lane.python, default=lane_name == "cpu")(lane_session)


for _lane in CATALOG.lanes:
    _make_lane(_lane)
