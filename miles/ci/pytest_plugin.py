"""pytest plugin: collect each test file only where it is registered to run.

Registrations are read from the collected file's syntax tree (miles.ci.registry.discover). A
file with no registration for this machine's backend is collected as one skip whose reason
names the hardware it needs, without importing it (its imports may need a GPU stack); a
file whose registration breaks a rule is a collection error carrying discovery's message.
The backend is `MILES_CI_BACKEND` (the runner sets it on GPU machines), else cpu.

Enable with `pytest_plugins = ("miles.ci.pytest_plugin",)` in the top conftest.py. Under the
runner it also records the session's phases (miles.phases): start-up until the tests are
collected, teardown from the end of the session until the process is gone. And it makes that
teardown short: at exit the objects left are frozen out of the garbage collector, which would
otherwise walk the whole of torch's and transformers' object graph on the way out (seconds per
file: most of a short file's time).
"""

from __future__ import annotations

import atexit
import gc
import os
from pathlib import Path

import pytest

from miles import phases
from miles.ci.registry.catalog import load_catalog
from miles.ci.registry.discover import Registration, parse_test_file

BACKEND_ENV = "MILES_CI_BACKEND"
ESTIMATES = pytest.StashKey[dict]()  # collected file -> its enabled registrations' largest est_time
atexit.register(gc.freeze)  # see the docstring: the interpreter frees them at exit regardless


def current_backend() -> str:
    return os.environ.get(BACKEND_ENV, "cpu")


class RegisteredElsewhere(pytest.File):
    """Stands in for a test module that must not be imported on this machine."""

    def __init__(self, *, reason: str, error: bool, **kwargs):
        super().__init__(**kwargs)
        self.reason = reason
        self.error = error

    def collect(self):
        if self.error:
            raise self.CollectError(self.reason)
        item = NotRunHere.from_parent(self, name=self.path.name)
        item.add_marker(pytest.mark.skip(reason=self.reason))  # reported at the file, not here
        yield item


class NotRunHere(pytest.Item):
    """The one item of a file registered for other hardware; its skip marker says which."""

    def runtest(self) -> None:
        raise AssertionError("a file registered elsewhere must never run here")

    def reportinfo(self):
        return self.path, 0, self.name


def hardware_needed(registrations: tuple[Registration, ...]) -> str:
    catalog = load_catalog()
    parts = []
    for r in registrations:
        suite = catalog.suites[r.suite]
        hardware = f"{suite.gpus}x {suite.hardware}" if suite.is_gpu else "cpu"
        parts.append(f"{hardware} ({r.backend}: {r.suite})")
    return " or ".join(parts)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector):
    config = parent.config
    try:
        rel = Path(module_path).resolve().relative_to(config.rootpath.resolve()).as_posix()
    except ValueError:
        return None
    if not Path(module_path).name.startswith("test_"):
        return None
    # Only the collected file is read: the runner starts one pytest per file.
    test_file, problems = parse_test_file(Path(module_path), rel, load_catalog())
    if problems:
        reason = "\n".join(str(p) for p in problems)
        return RegisteredElsewhere.from_parent(parent, path=Path(module_path), reason=reason, error=True)
    backend = current_backend()
    here = test_file.for_backend(backend)
    if not here:
        reason = f"registered for {hardware_needed(test_file.registrations)}; this machine is {backend}"
        return RegisteredElsewhere.from_parent(parent, path=Path(module_path), reason=reason, error=False)
    enabled = [r.est_time for r in here if r.enabled]
    if not enabled:
        reason = "; ".join(f"disabled on {r.backend} ({r.suite}): {r.disabled}" for r in here)
        return RegisteredElsewhere.from_parent(parent, path=Path(module_path), reason=reason, error=False)
    config.stash.setdefault(ESTIMATES, {})[str(module_path)] = max(enabled)
    return None


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's --dist loadfile hands out files by their count of tests, most first, which
    # leaves the long training files (a few tests each) for the end, where one of them can hold
    # the run while every other worker idles; the files come in longest-first order instead
    # (pytest_collection_modifyitems), which xdist keeps only with its reorder off.
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Files longest first by their registered est_time (longest-processing-time first: the
    last file to start is a short one), each file's tests in their own order."""
    estimates = config.stash.get(ESTIMATES, {})
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(str(item.path), len(first_seen))
    items.sort(key=lambda item: (-estimates.get(str(item.path), 0.0), first_seen[str(item.path)]))


_sessions: list[pytest.Session] = []  # the process's own session first; a test's inner ones (pytester) after


def pytest_sessionstart(session: pytest.Session) -> None:
    _sessions.append(session)


def pytest_collection_finish(session: pytest.Session) -> None:
    if _sessions and session is _sessions[0]:
        phases.started()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _sessions and session is _sessions[0]:
        phases.teardown_until_the_end()
    if session in _sessions:
        _sessions.remove(session)
