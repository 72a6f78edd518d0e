"""GPU-lane preflight: what a lane needs, each check's one line, leftovers, and the exit code.

There is no GPU here. Where a check needs what a GPU machine would report, the test builds
that report (a `PlatformInfo` as torch would describe an MI350 runner) or puts a stand-in
`rocm-smi` on PATH, and says so; processes, disks, locks and the CLI are real.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from miles.ci.machine.preflight import (
    EXIT_PREFLIGHT,
    JobScope,
    check_disk,
    check_leftovers,
    check_pins,
    check_vendor,
    find_leftovers,
    need_for,
    python_available,
    split_lane_args,
)
from miles.ci.register import register_cpu_ci
from miles.ci.registry.catalog import UnknownName
from miles.image.pins import parse_lock
from miles.platform import Platform, PlatformInfo

register_cpu_ci(est_time=5, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
# What torch reports on a full MI350 host (stand-in: no AMD GPU exists here).
MI350_HOST = PlatformInfo(Platform.ROCM, 8, "rocm 7.2", "torch 2.14.1+rocm7.2")
CPU_HOST = PlatformInfo(Platform.CPU, 0, "cpu", "torch 2.13.0+cpu")


@pytest.fixture
def smi_path(tmp_path: Path) -> str:
    """A PATH holding a stand-in rocm-smi, as on an AMD runner."""
    tool = tmp_path / "rocm-smi"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    return f"{tmp_path}{os.pathsep}/usr/bin:/bin"


def test_a_lane_needs_the_most_gpus_of_its_chosen_suites():
    assert need_for("rocm-mi350").gpus == 4
    assert need_for("cuda-h200").gpus == 8
    assert need_for("cuda-h200", ["stage-b-2-gpu-h200"]).gpus == 2
    assert need_for("cpu").gpus == 0


def test_a_suite_of_another_backend_is_an_unknown_name():
    with pytest.raises(UnknownName, match="stage-c-4-gpu-h200"):
        need_for("rocm-mi350", ["stage-c-4-gpu-h200"])


def test_wrong_vendor_is_one_line_naming_what_is_needed_and_what_is_here(smi_path):
    (line,) = check_vendor(need_for("rocm-mi350"), {"PATH": smi_path}, CPU_HOST)
    assert line.startswith("vendor: lane rocm-mi350 needs 4 AMD GPU(s) (rocm) for stage-c-4-gpu-mi350;")
    assert "this machine is cpu with 0 visible GPU(s)" in line


def test_missing_vendor_tools_are_their_own_line():
    lines = check_vendor(need_for("rocm-mi350"), {"PATH": "/nonexistent"}, MI350_HOST)
    assert lines == ["tools: none of amd-smi, rocm-smi is on PATH; the AMD driver tools are missing"]


def test_visible_devices_limit_the_gpu_count(smi_path):
    env = {"PATH": smi_path, "HIP_VISIBLE_DEVICES": "0,1"}
    (line,) = check_vendor(need_for("rocm-mi350"), env, MI350_HOST)
    assert line.startswith(
        "gpus: stage-c-4-gpu-mi350 needs 4 visible GPU(s), 2 visible HIP_VISIBLE_DEVICES=0,1"
    )
    assert check_vendor(need_for("rocm-mi350"), {**env, "HIP_VISIBLE_DEVICES": "4,5,6,7"}, MI350_HOST) == []


def test_platform_variable_for_another_backend_is_refused(smi_path):
    env = {"PATH": smi_path, "MILES_HARDWARE_PLATFORM": "cuda"}
    (line,) = check_vendor(need_for("rocm-mi350"), env, MI350_HOST)
    assert line.startswith("platform: MILES_HARDWARE_PLATFORM=cuda but lane rocm-mi350 runs rocm")


def test_platform_variable_contradicting_the_torch_build_is_refused(smi_path):
    cuda_build_on_amd = PlatformInfo(Platform.ROCM, 4, "cuda 13.0", "torch 2.14.1")
    env = {"PATH": smi_path, "MILES_HARDWARE_PLATFORM": "rocm"}
    lines = check_vendor(need_for("rocm-mi350"), env, cuda_build_on_amd)
    assert any(line.startswith("platform: MILES_HARDWARE_PLATFORM=rocm but") for line in lines)


def test_cpu_lanes_need_no_gpu_checks():
    assert check_vendor(need_for("cpu"), {"PATH": "/nonexistent"}, CPU_HOST) == []


def test_pins_report_wrong_versions_before_missing_ones():
    lock = parse_lock(ROOT / "requirements" / "rocm-mi350.txt", root=ROOT)
    installed = {name: pin.version for name, pin in lock.pins.items()}
    installed["torch"] = "2.13.0+cpu"
    del installed["numba"]
    lines = check_pins("rocm-mi350", installed)
    assert lines[0].startswith(
        "pins: torch: found 2.13.0+cpu, lock pins 2.14.1+rocm7.2 (requirements/rocm-mi350.txt:"
    )
    assert lines[1].startswith("pins: numba: missing, lock pins 0.65.1")


def test_an_absent_stack_is_summarised_not_listed_in_full():
    lines = check_pins("rocm-mi350", {})
    assert len(lines) == 12
    assert "this interpreter does not run the rocm-mi350 stack" in lines[-1]


def test_the_installed_cpu_stack_matches_its_lock():
    assert check_pins("cpu") == []


def test_low_disk_names_the_folder_and_the_threshold(tmp_path):
    (line,) = check_disk(tmp_path / "models" / "not-yet", 10**9)
    assert line.startswith("disk: ") and f"under {tmp_path / 'models' / 'not-yet'}" in line
    assert check_disk(tmp_path, 0.001) == []


@pytest.fixture
def stray():
    """A real process whose command line carries a unique marker, like a job's leftover."""
    marker = f"miles-leftover-{uuid.uuid4().hex[:12]}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker])
    # Under load the child may not have exec'd yet (its command line is still the parent's):
    # wait, bounded, until /proc shows the marker.
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 60
    while marker.encode() not in cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker.encode() in cmdline.read_bytes(), "the stray process never exec'd"
    yield marker, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_leftovers_are_reported_and_left_alone_without_clean(stray):
    marker, proc = stray
    problems, notes = check_leftovers(clean=False, patterns=[marker])
    assert len(problems) == 1 and problems[0].startswith(f"processes: pid {proc.pid} (")
    assert "rerun with --clean" in problems[0] and notes == []
    time.sleep(0.1)
    assert proc.poll() is None


def test_clean_kills_leftovers(stray):
    marker, proc = stray
    problems, notes = check_leftovers(clean=True, patterns=[marker])
    assert problems == [] and notes[0].startswith(f"killed pid {proc.pid}")
    assert proc.wait(timeout=10) is not None


def test_preflight_never_counts_itself_or_its_parents():
    own = " ".join(Path(f"/proc/{os.getpid()}/cmdline").read_text().split("\0")[:2])
    assert all(p.pid != os.getpid() for p in find_leftovers([re_escape(own)]))


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_lane_flags_are_split_from_runner_arguments():
    args = split_lane_args(["--system", "--suite", "stage-b-2-gpu-h200", "--shard", "1/2", "--clean"])
    assert (args.system, args.clean, args.plan) == (True, True, False)
    assert args.suites == ("stage-b-2-gpu-h200",)
    assert args.runner == ("--suite", "stage-b-2-gpu-h200", "--shard", "1/2")
    assert split_lane_args(["--plan", "--suite=stage-c-4-gpu-mi350"]).suites == ("stage-c-4-gpu-mi350",)


def test_cli_on_a_machine_without_amd_gpus_exits_3_with_one_line_per_problem(tmp_path):
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "MILES_PREFLIGHT_MIN_FREE_GB": "0",
    }
    env.pop("HIP_VISIBLE_DEVICES", None)
    done = subprocess.run(
        [sys.executable, "-m", "miles.ci", "preflight", "--lane", "rocm-mi350", "--machine-only"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_PREFLIGHT
    lines = done.stderr.splitlines()
    assert all(line.startswith("preflight: ") for line in lines)
    # a machine without Python 3.12 adds its line first; the rest follow in order
    tools = lines.index(
        "preflight: tools: none of amd-smi, rocm-smi is on PATH; the AMD driver tools are missing"
    )
    assert all(line.startswith("preflight: python: ") for line in lines[:tools])
    assert lines[tools + 1].startswith("preflight: vendor: lane rocm-mi350 needs 4 AMD GPU(s)")
    # processes other jobs on this machine left running may add lines; the count covers them all
    assert (
        lines[-1]
        == f"preflight: lane rocm-mi350 cannot run here ({len(lines) - 1} problem(s)); no test was started"
    )


def test_the_running_interpreter_counts_as_available():
    assert python_available("{}.{}".format(*sys.version_info[:2]))


def test_a_python_nobody_installed_is_reported_with_how_to_get_it(monkeypatch):
    from miles.ci.machine import preflight as module

    monkeypatch.setattr(module, "python_available", lambda version: False)
    (line,) = module.check_python("rocm-mi350")
    assert line.startswith(
        "python: lane rocm-mi350 runs on Python 3.12, and no working python3.12 is on PATH"
    )
    assert python_available("3.99") is False


# ------------------------------------------------------------------ only this job's processes


def _spawn(marker: str, *, env: dict | None = None, user: int | None = None) -> subprocess.Popen:
    """A real process whose command line carries `marker`, once /proc shows it exec'd."""
    python = "/usr/bin/python3" if user is not None else sys.executable  # another user may not read ours
    proc = subprocess.Popen(
        [python, "-c", "import time; time.sleep(120)", marker], env=env, user=user, cwd="/"
    )
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 60
    while marker.encode() not in cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker.encode() in cmdline.read_bytes(), "the process never exec'd"
    return proc


@pytest.fixture
def spawned():
    procs: list[subprocess.Popen] = []

    def spawn(marker: str, **kw) -> subprocess.Popen:
        procs.append(_spawn(marker, **kw))
        return procs[-1]

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_sibling_runners_process_survives_clean(spawned):
    """Two runners on one host (an MI350 host is two 4-GPU runners): this runner's leftover is
    killed, the sibling runner's process with the same command line is left alone."""
    marker = f"miles-leftover-{uuid.uuid4().hex[:12]}"
    runner = f"mi350-a-{uuid.uuid4().hex[:8]}"
    ours = spawned(marker, env={**os.environ, "RUNNER_NAME": runner})
    sibling = spawned(marker, env={**os.environ, "RUNNER_NAME": "mi350-b"})
    scope = JobScope.current({"RUNNER_NAME": runner})
    problems, notes = check_leftovers(clean=True, patterns=[marker], scope=scope)
    assert problems == []
    assert f"left alone: pid {sibling.pid} (" in notes[0]
    assert f"another runner's (RUNNER_NAME=mi350-b, this job's is {runner})" in notes[0]
    assert notes[1].startswith(f"killed pid {ours.pid}")
    assert ours.wait(timeout=10) is not None
    time.sleep(0.1)
    assert sibling.poll() is None


def test_preflight_clean_kills_only_this_runners_leftovers(spawned):
    # the command line of a trainer a dead job left behind (a pattern preflight looks for)
    marker = f"miles-leftover-{uuid.uuid4().hex[:12]}"
    runner = f"mi350-a-{uuid.uuid4().hex[:8]}"
    ours = spawned(f"-m miles.train --{marker}", env={**os.environ, "RUNNER_NAME": runner})
    sibling = spawned(f"-m miles.train --{marker}", env={**os.environ, "RUNNER_NAME": "mi350-b"})
    env = {**os.environ, "RUNNER_NAME": runner, "MILES_PREFLIGHT_MIN_FREE_GB": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "miles.ci", "preflight", "--lane", "cpu", "--machine-only", "--clean"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"preflight: killed pid {ours.pid} (" in done.stdout
    assert f"preflight: left alone: pid {sibling.pid} (" in done.stdout
    assert ours.wait(timeout=10) is not None and sibling.poll() is None


def test_a_process_older_than_the_job_is_not_the_jobs(stray):
    marker, proc = stray
    scope = dataclasses.replace(JobScope.current(os.environ), since=time.time() + 1)
    problems, notes = check_leftovers(clean=True, patterns=[marker], scope=scope)
    assert problems == [] and notes == [f"left alone: {notes[0].split(': ', 1)[1]}"]
    assert notes[0].endswith(": started before this job")
    time.sleep(0.1)
    assert proc.poll() is None


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another user needs root")
def test_another_users_process_survives_clean(spawned):
    marker = f"miles-leftover-{uuid.uuid4().hex[:12]}"
    other = spawned(marker, user=65534, env={"PATH": "/usr/bin:/bin"})
    problems, notes = check_leftovers(clean=True, patterns=[marker], scope=JobScope.current({}))
    assert problems == [] and notes == [notes[0]] and "another user's (uid 65534)" in notes[0]
    time.sleep(0.1)
    assert other.poll() is None


def _foreign_cgroup() -> Path | None:
    """A new cgroup outside this process's own (next to it at a hierarchy's root), or None
    where none can be made (not root, or no writable hierarchy where we are below the root)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if path == "/":
            continue
        mounts = (
            [Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")]
            if not controllers
            else [Path("/sys/fs/cgroup") / controllers]
        )
        for mount in mounts:
            if (mount / "cgroup.procs").exists():
                target = mount / f"miles-sibling-{uuid.uuid4().hex[:8]}"
                try:
                    target.mkdir()
                except OSError:
                    continue
                return target
    return None


@pytest.fixture
def foreign_cgroup():
    target = _foreign_cgroup()
    if target is None:
        pytest.skip("no cgroup outside this process's own can be made here (needs root and cgroupfs)")
    yield target
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            target.rmdir()
            return
        except OSError:
            time.sleep(0.05)  # the moved process is still exiting


def test_a_process_in_another_cgroup_survives_clean(spawned, foreign_cgroup):
    """A sibling runner's service has a cgroup of its own: its processes are never this job's."""
    marker = f"miles-leftover-{uuid.uuid4().hex[:12]}"
    sibling = spawned(marker)
    (foreign_cgroup / "cgroup.procs").write_text(str(sibling.pid))
    problems, notes = check_leftovers(clean=True, patterns=[marker], scope=JobScope.current({}))
    assert problems == [] and "in another cgroup (another runner or service)" in notes[0]
    time.sleep(0.1)
    assert sibling.poll() is None
    sibling.kill()
    sibling.wait()
