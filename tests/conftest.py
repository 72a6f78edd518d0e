"""Collect each test file only where it is registered to run.

The registrations are read from the syntax tree (miles.ci.discover). A file with no
registration for this machine's backend is collected as one skip whose reason names the
hardware it needs, without importing it; a file with a broken registration is a collection
error carrying discovery's message. The backend is `MILES_CI_BACKEND` (set by the runner on
GPU machines), else cpu.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import pytest

from miles.ci.catalog import load_catalog
from miles.ci.discover import Discovery, discover

ROOT = Path(__file__).resolve().parent.parent


@lru_cache(maxsize=1)
def _discovery() -> Discovery:
    return discover(ROOT, catalog=load_catalog())


def _backend() -> str:
    return os.environ.get("MILES_CI_BACKEND", "cpu")


class _NotHere(pytest.File):
    """Stands in for a test module that must not be imported on this machine."""

    def __init__(self, *, reason: str, error: bool, **kwargs):
        super().__init__(**kwargs)
        self._reason = reason
        self._error = error

    def collect(self):
        if self._error:
            raise self.CollectError(self._reason)
        pytest.skip(self._reason)


def _needs(registrations, catalog) -> str:
    parts = []
    for r in registrations:
        suite = catalog.suites[r.suite]
        hardware = f"{suite.gpus}x {suite.hardware}" if suite.is_gpu else "cpu"
        parts.append(f"{hardware} ({r.backend}: {r.suite})")
    return " or ".join(parts)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent):
    try:
        rel = Path(module_path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None
    discovery = _discovery()
    problems = [p for p in discovery.problems if p.file == rel]
    if problems:
        message = "\n".join(str(p) for p in problems)
        return _NotHere.from_parent(parent, path=Path(module_path), reason=message, error=True)
    test_file = discovery.file(rel)
    if test_file is None:
        return None
    backend = _backend()
    here = test_file.for_backend(backend)
    if not here:
        reason = (
            f"registered for {_needs(test_file.registrations, load_catalog())}; this machine is {backend}"
        )
        return _NotHere.from_parent(parent, path=Path(module_path), reason=reason, error=False)
    if all(not r.enabled for r in here):
        reason = "; ".join(f"disabled on {r.backend} ({r.suite}): {r.disabled}" for r in here)
        return _NotHere.from_parent(parent, path=Path(module_path), reason=reason, error=False)
    return None
