"""The `RESULT <json>` line a worker prints, and reading it back from the launch's output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

PREFIX = "RESULT "
TAIL = 4000  # characters of output a failed launch shows


def emit(payload: Any) -> None:
    """Print one result line (a worker calls this, usually on rank 0 only) in one write(2): the
    ranks of a launch share its stdout, and print's separate writes of a line and its newline
    can interleave with another rank's."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (PREFIX + json.dumps(payload) + "\n").encode())


def results(proc: subprocess.CompletedProcess) -> list[Any]:
    """Every result line of a launch that succeeded; the launch's own output when it did not, or
    when it printed no result."""
    found = [json.loads(line[len(PREFIX) :]) for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    assert proc.returncode == 0 and found, (
        f"exit code {proc.returncode}, {len(found)} result line(s)\n" + (proc.stdout + proc.stderr)[-TAIL:]
    )
    return found


def result(proc: subprocess.CompletedProcess) -> Any:
    """The one result of a launch (its last result line, should a worker print more)."""
    return results(proc)[-1]
