"""A test process forked by the runner's warm process sees what a fresh `python -m pytest` sees.

The CPU lane forks each file's pytest from a process that has imported torch, transformers and
megatron-core (miles.ci.running.warm). Here the same test file runs both ways and records its
command line, directory, environment, session, standard streams, signal handlers and random
state; only the preloaded modules may differ. Its exit status, a signal that kills it, its atexit
handlers, its CPU seconds and its phase records reach the runner as they do from a Popen child.
Containment under the warm process (escapees stopped after a pass, a timeout, a cancel) is in
tests/unit/test_runner_processes.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ci.running.execute import CancelToken, Settings, TestRun, run_attempt
from miles.ci.running.warm import MIN_FILES, wanted

register_cpu_ci(est_time=25, suite="stage-a-cpu")

SEES = """
import json, os, random, signal, sys, time
from pathlib import Path

OUT = Path(os.environ["WARM_OUT"])
ASKED = json.loads((OUT / "asked.json").read_text())  # not in the environment: one warm process serves all


def test_sees():
    null = os.stat(os.devnull)
    stdin = os.fstat(0)  # (pytest's capture holds 1 and 2 during a test; the output log shows them)
    busy = time.process_time() + 0.5
    while time.process_time() < busy:  # CPU the runner must count
        pass
    import atexit
    atexit.register(lambda: (OUT / "atexit").write_text("ran"))
    seen = {
        "argv0": Path(sys.argv[0]).as_posix().split("/")[-2:],
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "env": {k: v for k, v in os.environ.items() if k.startswith(("MILES_CI_", "WARM_"))},
        "session_leader": os.getsid(0) == os.getpid(),
        "stdin_null": (stdin.st_rdev, stdin.st_ino) == (null.st_rdev, null.st_ino),
        "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "main": sys.modules["__main__"].__spec__.name,
        "random": random.random(),
        "preloaded": "torch" in sys.modules,
    }
    import torch

    info = torch.__config__.parallel_info().splitlines()
    seen["threads"] = [torch.get_num_threads(), [line for line in info if "_get_max_threads" in line]]
    (OUT / f"seen-{ASKED['run']}.json").write_text(json.dumps(seen))
    assert not ASKED.get("fail"), "asked to fail"
    if ASKED.get("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
"""


def _attempt(root: Path, out: Path, run: str, *, warm: bool, **asked: bool):
    (out / "asked.json").write_text(json.dumps({"run": run, **asked}))
    # without OMP_NUM_THREADS (a lane of several jobs sets it): torch's default threads, deferred
    # in the warm process and asked for in each child, must be a fresh process's
    # nor the fork server of a lane this test runs in: the runner under test gives its own, or none
    drop = ("OMP_NUM_THREADS", "MILES_FORK_SERVER")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_CI_") and k not in drop}
    env.update(WARM_OUT=str(out))
    settings = Settings(root=root, grace=0.5, base_env=env, warm=warm)
    test = TestRun("tests/test_sees.py", "cpu", "stage-b-cpu", "cpu", "1/1", 5.0, 300.0)
    return run_attempt(test, root / "attempts" / run, settings, CancelToken())


@pytest.fixture(autouse=True, scope="module")
def _end_the_warm_process():
    """The warm process a test here starts ends with the module, not with the pytest worker."""
    yield
    from miles.ci.running import warm

    warm.close()


def _same(env: dict) -> dict:
    """The variables every attempt shares (each has its own token and folders)."""
    return {k: v for k, v in env.items() if k != "MILES_CI_ATTEMPT_TOKEN" and "/attempts/" not in v}


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sees.py").write_text(SEES)
    out = tmp_path / "out"
    out.mkdir()
    return tmp_path, out


def test_a_forked_test_process_sees_what_a_fresh_one_sees(tree):
    root, out = tree
    runs = {}
    for run, warm in (("fresh", False), ("warm-1", True), ("warm-2", True)):
        attempt = _attempt(root, out, run, warm=warm)
        assert attempt.status == "passed", attempt.output_tail
        assert "1 passed" in (root / "attempts" / run / "output.log").read_text()  # its output came back
        assert attempt.cpu >= 0.5, attempt.cpu  # the forked process's CPU is counted (wait4)
        assert (out / "atexit").read_text() == "ran"  # it ended through the interpreter's shutdown
        (out / "atexit").unlink()
        runs[run] = json.loads((out / f"seen-{run}.json").read_text())
        if warm:  # its start-up is the fork, not the imports it was spared
            assert dict(attempt.phases)["start"] < 2.0, attempt.phases
    fresh, warm1, warm2 = runs["fresh"], runs["warm-1"], runs["warm-2"]
    assert (fresh["preloaded"], warm1["preloaded"]) == (False, True)
    assert fresh["argv0"] == ["pytest", "__main__.py"] and fresh["main"] == "pytest.__main__"
    assert fresh["session_leader"] and fresh["stdin_null"]
    assert fresh["sigint"] and fresh["sigterm"] and fresh["cwd"] == str(root)
    for seen in (warm1, warm2):
        assert {k: v for k, v in seen.items() if k not in ("preloaded", "random", "env")} == {
            k: v for k, v in fresh.items() if k not in ("preloaded", "random", "env")
        }
        assert _same(seen["env"]) == _same(fresh["env"]) and set(seen["env"]) == set(fresh["env"])
    for run, seen in runs.items():
        assert seen["env"]["MILES_CI_PHASE_DIR"].endswith(f"/attempts/{run}/phases")
    assert warm1["random"] != warm2["random"]  # each child seeds from the OS, as a fresh one does


def test_a_failing_or_killed_forked_test_is_reported_as_from_a_fresh_process(tree):
    root, out = tree
    for warm in (False, True):
        failed = _attempt(root, out, f"fail-{warm}", warm=warm, fail=True)
        assert (failed.status, failed.exit_code) == ("failed", 1), failed.output_tail
        assert "asked to fail" in failed.output_tail
        killed = _attempt(root, out, f"kill-{warm}", warm=warm, kill=True)
        assert (killed.status, killed.signal) == ("failed", "SIGKILL"), (killed.status, killed.signal)


def test_the_lane_forks_from_a_warm_process_only_where_it_pays_and_never_when_told_not_to():
    assert wanted({}, MIN_FILES) and not wanted({}, MIN_FILES - 1)
    assert not wanted({"MILES_CI_WARM": "0"}, 500)
    assert wanted({"MILES_CI_WARM": "1"}, 1)
    assert not wanted({"MILES_CI_ATTEMPT_TOKEN": "x"}, 500)  # a runner inside a test: its own small lanes
    with pytest.raises(ValueError, match="MILES_CI_WARM='yes': give 1"):
        wanted({"MILES_CI_WARM": "yes"}, 500)


def test_a_malformed_switch_is_refused_in_one_line_with_exit_2():
    env = {**os.environ, "MILES_CI_WARM": "yes", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-m", "miles.ci", "run", "--lane", "cpu", "--plan"],
        env=env,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 2, done.stderr
    assert "MILES_CI_WARM='yes': give 1" in done.stderr and len(done.stderr.strip().splitlines()) == 1


LAUNCHES = """
import json, os, subprocess, sys
from pathlib import Path

OUT = Path(os.environ["WARM_OUT"])
ASKED = json.loads((OUT / "asked.json").read_text())
RANK = '''
import json, os, sys, time
served = "torch" in sys.modules  # a launch of its own preloads nothing for a script; the server did
end = time.process_time() + 0.5
while time.process_time() < end:  # CPU the runner must count, wherever the rank was forked
    pass
from miles.cgroups import own_cgroup
line = json.dumps({"rank": os.environ["RANK"], "served": served, "cgroup": own_cgroup()})
os.write(1, (line + "\\\\n").encode())  # one write: under PYTHONUNBUFFERED print writes the newline apart
'''


def test_launches():
    (OUT / "rank.py").write_text(RANK)
    done = subprocess.run(
        [sys.executable, "-m", "miles.train.forked_ranks", "--nproc-per-node", "2", str(OUT / "rank.py")],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    from miles.cgroups import own_cgroup

    ranks = [json.loads(line) for line in done.stdout.splitlines()]
    seen = {"server": os.environ.get("MILES_FORK_SERVER"), "stderr": done.stderr,
            "ranks": sorted(r["served"] for r in ranks), "cgroups": [r["cgroup"] == own_cgroup() for r in ranks]}
    (OUT / f"launch-{ASKED['run']}.json").write_text(json.dumps(seen))
"""


def test_a_lanes_cpu_launches_are_forked_by_its_fork_server_and_their_cpu_counted(tree):
    root, out = tree
    (root / "tests" / "test_sees.py").write_text(LAUNCHES)
    for run, warm in (("fresh", False), ("warm", True)):
        attempt = _attempt(root, out, run, warm=warm)
        assert attempt.status == "passed", attempt.output_tail
        assert attempt.cpu >= 2 * 0.5, attempt.cpu  # both ranks' busy loops, served or not
        seen = json.loads((out / f"launch-{run}.json").read_text())
        assert "fork server" not in seen["stderr"], seen["stderr"]  # never refused
        assert seen["cgroups"] == [True, True]  # the ranks are in the attempt's cgroup, as its test is
        if warm:
            assert seen["server"] and seen["ranks"] == [True, True]
        else:
            assert seen["server"] is None and seen["ranks"] == [False, False]
