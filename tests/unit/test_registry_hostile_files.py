"""Discovery survives any file under tests/: one the parser gives up on, a folder it may not
list, a file too large to be a test, a cache file that came with a checkout. Each is one line
for the lanes it concerns; the other lanes plan and run as if it were not there.

The commands are the ones a user types (`python -m miles.ci plan | list | audit`), through
`main`, or as a subprocess where the test must give up root's power to read anything.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.ci.cli import main
from miles.ci.register import register_cpu_ci
from miles.ci.registry.discover import discover

register_cpu_ci(est_time=2, suite="stage-a-cpu")

CPU = 'from miles.ci.register import register_cpu_ci\nregister_cpu_ci(est_time=5, suite="stage-b-cpu")\n'
CUDA = (
    "from miles.ci.register import register_cuda_ci\n"
    'register_cuda_ci(est_time=60, suite="stage-c-4-gpu-h200", labels=["megatron"])\n'
)
N = 100_000
DEEP = {
    "a unary chain": "x = " + "-" * N + "1\n",
    "a long sum": "x = " + "+".join(["1"] * N) + "\n",
    "nested lambdas": "x = " + "lambda: " * N + "1\n",
    "nested lists": "x = " + "[" * N + "]" * N + "\n",
    "a NUL byte": "x = 1\0\n",
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for key in ("GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY", "MILES_DURATIONS_PATH", "MILES_HISTORY_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))  # the signing key lives here


@pytest.mark.parametrize("case", list(DEEP))
def test_a_file_the_parser_gives_up_on_is_one_line_and_other_lanes_plan(make_tree, capsys, case):
    """The issue's case: a deeply nested expression before the registration crashed discovery
    (RecursionError / MemoryError) for every lane."""
    root = make_tree({"tests/e2e/test_deep.py": DEEP[case] + CPU, "tests/e2e/test_gpu.py": CUDA})
    assert main(["plan", "--root", str(root), "--lane", "cuda-h200", "--suite", "stage-c-4-gpu-h200"]) == 0
    assert "tests/e2e/test_gpu.py" in capsys.readouterr().out
    # its own suite plans it as a failing row of its own (a refused registration fails its file,
    # the rest of the suite runs), in one line
    assert main(["plan", "--root", str(root), "--suite", "stage-b-cpu"]) == 0
    said = capsys.readouterr()
    refused = [line for line in said.out.splitlines() if "tests/e2e/test_deep.py:1: " in line]
    assert len(refused) == 1 and "fails (registration refused)" in refused[0], said.out
    assert "registrations cannot be read" in refused[0]
    assert "Traceback" not in said.out + said.err


def test_marker_arguments_nested_too_deeply_are_one_line(make_tree, capsys):
    deep = "+".join(["1"] * 1500)  # parses, but reading it as a literal (or printing it) recurses
    root = make_tree(
        {
            "tests/e2e/test_x.py": "from miles.ci.register import register_cpu_ci\n"
            f'register_cpu_ci(est_time={deep}, suite="stage-b-cpu")\n',
            "tests/e2e/test_gpu.py": CUDA,
        }
    )
    (problem,) = discover(root).problems
    assert (problem.line, problem.backends) == (2, ("cpu",)) and "nested too deeply" in problem.message
    assert main(["plan", "--root", str(root), "--lane", "cuda-h200", "--suite", "stage-c-4-gpu-h200"]) == 0


def test_a_test_file_too_large_to_be_one_is_refused_unread(make_tree):
    root = make_tree({"tests/e2e/test_gpu.py": CUDA})
    with open(root / "tests/e2e/test_huge.py", "wb") as fh:
        fh.truncate(65 << 20)  # sparse: takes no disk
    (problem,) = discover(root).problems
    assert problem.file == "tests/e2e/test_huge.py" and "over the 67108864-byte limit" in problem.message


def _drop_read_override() -> None:
    """In the child, before exec: root loses the capabilities that bypass file permissions."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH (<linux/capability.h>)
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _cli(*argv: str) -> subprocess.CompletedProcess:
    demote = _drop_read_override if os.geteuid() == 0 else None
    try:
        return subprocess.run(
            [sys.executable, "-m", "miles.ci", *argv], capture_output=True, text=True, preexec_fn=demote,
            check=False, timeout=120,
        )  # fmt: skip
    except subprocess.SubprocessError as exc:
        pytest.skip(f"cannot drop CAP_DAC_OVERRIDE for the child ({exc}); run as a non-root user instead")


def test_an_unreadable_folder_under_tests_warns_every_lane_and_stops_none(make_tree):
    """The issue's case: an unreadable folder under tests/ crashed every lane."""
    root = make_tree({"tests/e2e/test_ok.py": CPU, "tests/private/test_hidden.py": CPU})
    (root / "tests" / "private").chmod(0)
    try:
        plan = _cli("plan", "--root", str(root), "--suite", "stage-b-cpu")
        audit = _cli("audit", "--root", str(root), "--strict")
    finally:
        (root / "tests" / "private").chmod(0o755)
    assert plan.returncode == 0, plan.stderr
    assert "tests/e2e/test_ok.py" in plan.stdout
    assert "tests/private:1: cannot list this folder (Permission denied)" in plan.stdout
    assert "Traceback" not in plan.stderr + audit.stderr
    assert audit.returncode == 1 and "tests/private" in audit.stdout


def test_a_file_name_that_would_start_a_workflow_command_is_escaped_in_the_plan(make_tree, capsys):
    name = "tests/e2e/test_x\n::error::forged.py"
    root = make_tree({name: CPU})
    assert main(["plan", "--root", str(root), "--suite", "stage-b-cpu"]) == 0
    out = capsys.readouterr().out
    assert "test_x\\x0a::error::forged.py" in out
    assert not [line for line in out.splitlines() if line.lstrip().startswith("::")]


def test_a_problem_naming_such_a_file_is_one_line_in_list(make_tree, capsys):
    root = make_tree({"tests/e2e/test_y\n::warning::x.py": 'register_cpu_ci(est_time=5, suite="nope")\n'})
    main(["list", "--root", str(root)])
    captured = capsys.readouterr()
    assert not [line for line in (captured.out + captured.err).splitlines() if line.lstrip().startswith("::")]


# -- the discovery cache ------------------------------------------------------------------


def _aged(root: Path) -> None:
    for path in (root / "tests").rglob("*.py"):
        stamp = time.time() - 60
        os.utime(path, (stamp, stamp))


def test_the_cache_is_json_never_pickle(make_tree):
    root = make_tree({"tests/e2e/test_ok.py": CPU})
    _aged(root)
    discover(root)
    signature, _, payload = (root / ".miles/cache/discover.json").read_bytes().partition(b"\n")
    assert len(signature) == 64 and "tests/e2e/test_ok.py" in json.loads(payload)["files"]
    assert not (root / ".miles/cache/discover.pickle").exists()


def test_a_committed_pickle_cache_is_never_loaded(make_tree, tmp_path):
    """The issue's case: a discover.pickle that came with the checkout was unpickled."""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    import pickle

    root = make_tree({"tests/e2e/test_ok.py": CPU})
    (root / ".miles/cache").mkdir(parents=True)
    for name in ("discover.pickle", "discover.json"):
        (root / ".miles/cache" / name).write_bytes(pickle.dumps(Evil()))
    _aged(root)
    assert [r.file for r in discover(root).registrations] == ["tests/e2e/test_ok.py"]
    assert not marker.exists()


def test_a_cache_signed_with_another_key_is_ignored(make_tree, tmp_path):
    """A crafted JSON cache (here one that hides a registration's problem and adds a test that
    does not exist) is ignored unless this user's key signed it."""
    root = make_tree({"tests/e2e/test_ok.py": CPU.replace("stage-b-cpu", "nope")})
    _aged(root)
    honest = discover(root)
    assert len(honest.problems) == 1
    path = root / ".miles/cache/discover.json"
    _, _, payload = path.read_bytes().partition(b"\n")
    data = json.loads(payload)
    entry = data["files"]["tests/e2e/test_ok.py"]
    entry[2] = [["cpu", "tests/e2e/test_ok.py", 2, 5.0, "stage-b-cpu", [], False, None, False]]
    entry[4] = []
    forged = json.dumps(data).encode()
    path.write_bytes(hmac.new(b"x" * 64, forged, hashlib.sha256).hexdigest().encode() + b"\n" + forged)
    again = discover(root)
    assert again.problems == honest.problems and again.registrations == ()


def test_without_a_place_for_the_key_nothing_is_cached_and_discovery_works(make_tree, monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    root = make_tree({"tests/e2e/test_ok.py": CPU})
    _aged(root)
    assert len(discover(root).registrations) == 1
    assert not (root / ".miles/cache/discover.json").exists()
