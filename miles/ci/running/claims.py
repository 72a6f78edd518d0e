"""Which job runs which file, in a run with jobs: the jobs take files from one queue.

Every job of a run walks the run's list of files (its suites in turn) and runs a file only after
taking it: it creates the file's claim, a file named after the test in the run's claims folder,
exclusively, and writes its job number into it. A claim another job made first means that job
has the file, so a job that finishes early goes on to the next file nobody took instead of
idling while the other works through a fixed share. A job records only what it took (its runs,
its fast-fail skips, its cancellations), so the run's report holds each file once; after the
jobs end the claims say whose record should hold each file, and which files no job took.

In a run that goes on after a failure (the list longest first), odd-numbered jobs walk each
suite from its longest file and even-numbered ones from its shortest (`walk`): the longest file
still starts first, and it runs beside short files rather than beside the next longest (two
trainings of two ranks each on two cores wait on each other's collectives); the walks meet in
the middle. A fast-fail run's jobs all walk shortest first.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from miles.files import Folder

if TYPE_CHECKING:
    from miles.ci.running.plan import PlannedTest

MAX_CLAIM_BYTES = 16  # a job number


def claim_name(suite: str, file: str) -> str:
    """The claim's file name: one per (suite, test file), one path component, short."""
    digest = hashlib.sha256(f"{suite}\0{file}".encode("utf-8", "surrogateescape")).hexdigest()[:20]
    return f"{suite}-{digest}"


class Claims:
    """The claims folder of a run, as job `job` of `jobs` (1-based) sees it."""

    def __init__(self, folder: Path, job: int, jobs: int):
        if not 1 <= job <= jobs:
            raise ValueError(f"job {job}/{jobs}: need 1 <= job <= jobs")
        self.folder = Path(folder)
        self.job = job
        self.jobs = jobs

    @property
    def label(self) -> str:
        """The job as a shard label ("j/N"): what its attempts report as their shard."""
        return f"{self.job}/{self.jobs}"

    def walk(self, tests: Sequence[PlannedTest], *, both_ends: bool) -> tuple[PlannedTest, ...]:
        """The order this job tries to take `tests` (the run's list) in: with `both_ends`, each
        suite's files reversed for an even-numbered job."""
        return walk(tests, self.job, both_ends=both_ends)

    def take(self, suite: str, file: str) -> bool:
        """Whether this job now runs `file` of `suite`: True when it made the claim, False when
        another job (or this one, earlier) had made it."""
        with Folder.open(self.folder) as folder:
            try:
                with folder.create(claim_name(suite, file)) as fh:
                    fh.write(str(self.job).encode())
            except FileExistsError:
                return False
        return True


def owners(folder: Path) -> dict[str, int]:
    """Each claim's job number by claim name; 0 for a claim whose job ended before writing it."""
    found: dict[str, int] = {}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return found
    with Folder.open(folder) as held:
        for name in names:
            if name.startswith("."):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=held.fd)
            except OSError:
                continue
            with os.fdopen(fd, "rb") as fh:
                text = fh.read(MAX_CLAIM_BYTES).decode("ascii", "replace").strip()
            found[name] = int(text) if text.isdigit() else 0
    return found


def walk(tests: Sequence[PlannedTest], job: int, *, both_ends: bool) -> tuple[PlannedTest, ...]:
    """Job `job`'s order of the run's list `tests` (see the module's docstring)."""
    if not both_ends or job % 2:
        return tuple(tests)
    suites = itertools.groupby(tests, key=lambda t: t.registration.suite)
    return tuple(t for _, group in suites for t in reversed(list(group)))
