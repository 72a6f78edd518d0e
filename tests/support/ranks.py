"""Launching ranks as a user does on the CPU: `python -m miles.train.forked_ranks` (the recipes' CPU
launcher: gloo ranks forked after the imports they share; torchrun's environment), gloo on the CPU.

`launch` starts a worker script or module on N ranks with one thread each and the project root on
their path (so workers import `tests.support` like the tests do); `trainer` is the same for
`python -m miles.train`, the command a user runs. Both return the finished process, output kept,
and count their timeout at the machine's load (`run`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT = 600
LOAD_STRETCH = 10.0


# What a worker's ranks import before their first collective, imported once before the fork.
PRELOAD = ("torch.distributed",)
# ... and for one that builds megatron-core models from transformers checkpoints
MEGATRON_PRELOAD = ("torch.distributed", "transformers", "megatron.core.models.gpt", "miles.families.model")


def torchrun(nproc: int, preload: Sequence[str] = PRELOAD) -> list[str]:
    """The launcher's own command line, up to the script or `-m module` (the name stays: it starts
    ranks with torchrun's environment; miles.train.forked_ranks)."""
    cmd = [sys.executable, "-m", "miles.train.forked_ranks", "--nproc-per-node", str(nproc)]
    for module in preload:
        cmd += ["--preload", module]
    return cmd


def rank_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, one thread per rank (two ranks share two cores), the project
    root first on the path."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(extra or {})}


def run(
    cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = DEFAULT_TIMEOUT
) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) with `timeout` counted at the machine's
    load (miles.load.run_counted: a shared 2-core machine makes ranks slow, not hung; a hung run
    still ends, at 10 x the timeout): TimeoutExpired when it runs out, the process killed."""
    from miles.load import run_counted

    return run_counted(cmd, timeout, stretch=LOAD_STRETCH, env=env)


def launch(
    target: str | Path,
    *args: str,
    nproc: int = 2,
    module: bool = False,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    preload: Sequence[str] = PRELOAD,
) -> subprocess.CompletedProcess:
    """Run `target` (a script path, or a module with module=True) with `args` on `nproc` ranks."""
    cmd = [*torchrun(nproc, preload), *(["-m", str(target)] if module else [str(target)]), *map(str, args)]
    return run(cmd, env=rank_env(env), timeout=timeout)


def trainer(
    args: Sequence[str],
    *,
    nproc: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> subprocess.CompletedProcess:
    """`python -m miles.train ARGS` on `nproc` ranks."""
    return launch("miles.train", *args, nproc=nproc, module=True, env=env, timeout=timeout)


def succeeded(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """The process, after asserting it exited 0 (its output's tail is the message when not)."""
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def case_results(
    worker: str | Path, cases: Mapping[str, object], *args: str, nproc: int = 2, preload: Sequence[str] = PRELOAD
) -> dict[str, object]:
    """Launch `worker ARGS CASES_JSON` once for every case; the worker's one `RESULT` line, a list
    in the cases' order, by case name."""
    import json

    from tests.support.results import result

    found = result(launch(worker, *args, json.dumps(list(cases.values())), nproc=nproc, preload=preload))
    assert isinstance(found, list) and len(found) == len(cases), found
    return dict(zip(cases, found, strict=True))
