"""A launch run by the trainer's fork server looks to its ranks and to its caller like one the
launcher forks itself (miles.train.fork_server).

The same worker runs under `python -m miles.train.forked_ranks` twice, once without and once
with MILES_FORK_SERVER, and records what a rank can see: its arguments, environment, directory,
umask, stdio buffering, torch's threads, signal handlers, `sys.path` and `sys.orig_argv`; only the
parent process and the preloaded modules may differ. Exit statuses, signals passed on, a launcher
killed outright (its ranks die with it), refusals that name what differs (the launch then forks
here), and the CPU the server reports are checked against real processes; the runner's use of it
in a lane is in tests/unit/test_runner_warm.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.train.fork_server import differences, usage

register_cpu_ci(est_time=15, suite="stage-a-cpu")

LAUNCH = [sys.executable, "-m", "miles.train.forked_ranks"]
ROOT = Path(__file__).resolve().parents[2]

SEES = """
import json, os, signal, sys
out = sys.argv[1]
import torch
mask = os.umask(0); os.umask(mask)
seen = {
    "argv": sys.argv[1:], "orig_argv": sys.orig_argv[1:], "name": __name__, "cwd": os.getcwd(),
    "env": {k: v for k, v in os.environ.items() if k not in ("MILES_FORK_SERVER", "MASTER_PORT")}, "umask": mask,
    "path": sys.path[1:], "threads": torch.get_num_threads(),
    "stdout": [sys.stdout.line_buffering, sys.stdout.write_through, sys.stdout.encoding, sys.stdout.errors],
    "stderr": [sys.stderr.line_buffering, sys.stderr.write_through, sys.stderr.errors],
    "signals": [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)],
    "session_of_launcher": os.getsid(0) == os.getsid(os.getppid()),
}
with open(os.path.join(out, os.environ["RANK"] + ".json"), "w") as f:
    json.dump(seen, f)
os.write(1, f"rank {os.environ['RANK']} done\\n".encode())  # one write: the ranks share the pipe
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A fork server in this test's environment (as the runner starts one per job), stopped after."""
    folder = tmp_path_factory.mktemp("server")
    path = str(folder / "s.sock")
    proc = subprocess.Popen(
        [*LAUNCH, "--serve", path, "--exit-with", str(os.getpid())],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env=_env(),
        start_new_session=True,
    )
    line = proc.stdout.readline()
    assert json.loads(line)["ready"] == path
    yield path
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    assert not os.path.exists(path)  # the socket goes with it


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MILES_FORK_SERVER", "OMP_NUM_THREADS")}
    return {**env, **extra}


def _launch(tmp_path: Path, body: str, *args: str, server: str | None = None, nproc: int = 2, **env):
    script = tmp_path / "worker.py"
    script.write_text(body)
    extra = {"MILES_FORK_SERVER": server} if server else {}
    return subprocess.run(
        [*LAUNCH, "--nproc-per-node", str(nproc), str(script), *args],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env(**extra, **env),
        preexec_fn=lambda: os.umask(0o027),  # not the server's: the launcher's must reach the ranks
    )  # fmt: skip


def _seen(out: Path) -> list[dict]:
    return [json.loads((out / f"{r}.json").read_text()) for r in ("0", "1")]


@pytest.mark.parametrize("threads", [None, "1"])
@pytest.mark.parametrize("unbuffered", [None, "1"])
def test_a_served_launch_shows_its_ranks_what_a_launch_of_its_own_does(tmp_path, server, threads, unbuffered):
    env = {k: v for k, v in (("OMP_NUM_THREADS", threads), ("PYTHONUNBUFFERED", unbuffered)) if v}
    seen = {}
    out = tmp_path / "out"  # the same command line both times
    for how in ("own", "served"):
        out.mkdir()
        done = _launch(tmp_path, SEES, str(out), "--flag", server=server if how == "served" else None, **env)
        assert done.returncode == 0, done.stderr
        assert "fork server" not in done.stderr, done.stderr  # served, not refused
        assert sorted(done.stdout.splitlines()) == ["rank 0 done", "rank 1 done"]
        seen[how] = _seen(out)
        out.rename(tmp_path / how)
    for own, served in zip(seen["own"], seen["served"], strict=True):
        assert {k: (own[k], served[k]) for k in own if own[k] != served[k]} == {}
    assert seen["own"][0]["argv"][1:] == ["--flag"] and seen["own"][0]["name"] == "__main__"


def test_exit_statuses_and_tracebacks_come_back_as_from_a_launch_of_its_own(tmp_path, server):
    failing = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(7)\ntime.sleep(600)\n"
    done = _launch(tmp_path, failing, server=server)
    assert done.returncode == 7 and "rank 1" in done.stderr and "exited with 7" in done.stderr
    killed = "import os, signal\nif os.environ['RANK'] == '0':\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    assert _launch(tmp_path, killed, server=server).returncode == 128 + signal.SIGKILL
    broken = _launch(tmp_path, "raise RuntimeError('broken rank')\n", server=server)
    assert broken.returncode == 1 and "RuntimeError: broken rank" in broken.stderr
    assert "fork server" not in broken.stderr


WAITS = """
import os, signal, sys, time
marks = sys.argv[1]
def bye(*_):
    open(os.path.join(marks, "bye" + os.environ["RANK"]), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
with open(os.path.join(marks, "up" + os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
"""


def _start_waiting(tmp_path: Path, server: str) -> tuple[subprocess.Popen, Path]:
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WAITS)
    proc = subprocess.Popen(
        [*LAUNCH, "--nproc-per-node", "2", str(script), str(marks)],
        stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env(MILES_FORK_SERVER=server),
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while len(list(marks.glob("up*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # both wrote their pid; give the handlers a moment to be in place
    return proc, marks


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def test_sigterm_to_the_launcher_reaches_every_served_rank(tmp_path, server):
    proc, marks = _start_waiting(tmp_path, server)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    assert sorted(p.name for p in marks.iterdir()) == ["bye0", "bye1", "up0", "up1"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_ranks_of_a_launcher_killed_outright_die_with_it(tmp_path, server):
    proc, marks = _start_waiting(tmp_path, server)
    ranks = [int((marks / f"up{r}").read_text()) for r in (0, 1)]
    assert all(_running(pid) for pid in ranks)
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(pid) for pid in ranks)
    assert not list(marks.glob("bye*"))  # killed, as a launch of its own's ranks would be by the kernel's death signal


def test_a_launch_whose_environment_an_import_may_read_is_refused_by_name_and_forks_here(tmp_path, server):
    out = tmp_path / "out"
    out.mkdir()
    done = _launch(tmp_path, SEES, str(out), server=server, TRANSFORMERS_VERBOSITY="error")
    assert done.returncode == 0, done.stderr
    assert "fork server" in done.stderr and "not used" in done.stderr
    assert "TRANSFORMERS_VERBOSITY" in done.stderr and "forking here" in done.stderr
    assert _seen(out)[0]["env"]["TRANSFORMERS_VERBOSITY"] == "error"  # and it ran, here


def test_which_variables_may_differ():
    base = {"PATH": "/bin", "HOME": "/root"}
    assert differences(base, {**base, "MILES_RECORD_DIR": "/x", "NCCL_DEBUG": "INFO", "SHLVL": "3"}) == []
    assert differences(base, {**base, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}) == []
    assert differences(base, {**base, "PYTHONPATH": "/x", "HF_HOME": "/y"}) == ["HF_HOME", "PYTHONPATH"]
    assert differences(base, {"PATH": "/usr/bin"}) == ["HOME", "PATH"]


def test_the_server_reports_the_cpu_of_the_launches_it_ran(tmp_path, server):
    before = usage(server)
    busy = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end:\n    pass\n"
    assert _launch(tmp_path, busy, server=server).returncode == 0
    after = usage(server)
    assert before is not None and after is not None
    assert after - before >= 2 * 0.5 * 0.9  # both ranks' busy loops, reaped through the launch
    assert usage(str(tmp_path / "no-server.sock")) is None


def test_a_programs_own_serve_flag_is_the_programs(tmp_path):
    done = _launch(tmp_path, "import sys\nprint(sys.argv[1:])\n", "--serve", "x", nproc=1)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['--serve', 'x']"
