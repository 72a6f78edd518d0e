"""Check the machine before a GPU lane runs a single test: `python -m miles.ci preflight`.

A lane needs its Python, the right vendor with enough visible GPUs for its suites, its pinned stack
installed (every package its rollout engine imports, kernels built for this GPU, a driver that
runs the stack: miles.ci.machine.gpu_stack), `MILES_HARDWARE_PLATFORM` consistent with the torch build,
free disk for checkpoints, and no processes left over from an earlier job. Each missing thing is one line;
any problem exits 3, before a GPU job starts and fails an hour later for the same reason.

`--machine-only` skips what needs the stack (pins), so the lane can run it before installing
anything. Leftover processes are reported; `--clean` kills them. Only this job's processes
count (`JobScope`): in its cgroup, of its user, started after the job, and under GitHub
Actions of its runner; another runner's on the same host (an MI350 host is two 4-GPU
runners) is named as left alone, never killed. Standard library only; torch is consulted
through miles.platform when it is installed.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from miles.ci.registry.catalog import Catalog, load_catalog

ROOT = Path(__file__).resolve().parents[3]
EXIT_PREFLIGHT = 3
MIN_FREE_GB = {"cpu": 5.0, "cuda": 100.0, "rocm": 100.0}  # checkpoints of 4/5-layer slices, FP8 + torch_dist
MIN_FREE_ENV = "MILES_PREFLIGHT_MIN_FREE_GB"
MODEL_DIR_ENV = "MILES_MODEL_DIR"
MAX_PIN_LINES = 12  # beyond this the stack is simply not installed; say so instead of listing all
VENDOR = {"cuda": "NVIDIA", "rocm": "AMD"}
VISIBLE_ENV = {"cuda": ("CUDA_VISIBLE_DEVICES",), "rocm": ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")}
SMI_TOOLS = {"cuda": ("nvidia-smi",), "rocm": ("amd-smi", "rocm-smi")}
RUNNER_ENV = "RUNNER_NAME"  # set by GitHub Actions in every step of a job: which runner runs it
# Command lines of the processes a training job leaves behind when its runner dies.
LEFTOVER_PATTERNS = (
    r"sglang\.launch_server",
    r"sglang::",
    r"\btorchrun\b",
    r"torch\.distributed\.run",
    r"\bray::",
    r"\braylet\b",
    r"\bgcs_server\b",
    r"-m miles\.train\b",
    r"\bpretrain_gpt\.py\b",
)


@dataclass(frozen=True)
class Need:
    """What the lane (or the chosen suites) asks of the machine."""

    lane: str
    backend: str
    gpus: int
    suites: tuple[str, ...]


@dataclass(frozen=True)
class Leftover:
    pid: int
    command: str
    age_s: float
    started: float = 0.0  # epoch seconds
    uid: int = -1  # real user id
    cgroup: str = ""  # /proc/<pid>/cgroup
    runner: str | None = None  # RUNNER_NAME in its environment ("" unset, None unreadable)

    def describe(self) -> str:
        hours, rest = divmod(int(self.age_s), 3600)
        return f"pid {self.pid} ({self.command[:80]}, running {hours}h{rest // 60:02d}m)"


@dataclass(frozen=True)
class JobScope:
    """What makes a process this job's, so that --clean never touches another job's."""

    cgroup: str  # this process's /proc/self/cgroup: a job's processes are in it or below it
    uid: int
    since: float  # the job's start: its oldest ancestor in the same cgroup, of the same user
    runner: str = ""  # RUNNER_NAME of this job under GitHub Actions ("" elsewhere)

    @classmethod
    def current(cls, env: Mapping[str, str], proc: Path = Path("/proc")) -> JobScope:
        boot = _boot_time(proc)
        me = _read_process(proc, os.getpid(), boot)
        since = me.started if me else time.time()
        for pid in _ancestor_chain(os.getpid(), proc)[1:]:
            parent = _read_process(proc, pid, boot)
            if parent is None or me is None or (parent.cgroup, parent.uid) != (me.cgroup, me.uid):
                break
            since = parent.started
        return cls(me.cgroup if me else "", me.uid if me else os.getuid(), since, env.get(RUNNER_ENV, ""))

    def not_ours(self, p: Leftover) -> str | None:
        """Why `p` belongs to another job, or None when it is this job's."""
        if p.uid != self.uid:
            return f"another user's (uid {p.uid})"
        if not _cgroup_within(p.cgroup, self.cgroup):
            return "in another cgroup (another runner or service)"
        if p.started < self.since:
            return "started before this job"
        if self.runner and p.runner != self.runner:
            shown = "unreadable" if p.runner is None else (p.runner or "unset")
            return f"another runner's ({RUNNER_ENV}={shown}, this job's is {self.runner})"
        return None


def _cgroup_within(theirs: str, ours: str) -> bool:
    """Whether every hierarchy of `theirs` is `ours` or below it (a test's own cgroup is)."""
    mine = _cgroup_paths(ours)
    other = _cgroup_paths(theirs)
    if not mine:
        return True  # no cgroups to tell jobs apart by
    for hierarchy, path in mine.items():
        found = other.get(hierarchy)
        if found is None or not (found == path or found.startswith(path.rstrip("/") + "/")):
            return False
    return True


def _cgroup_paths(text: str) -> dict[str, str]:
    """hierarchy id:controllers -> path, from /proc/<pid>/cgroup."""
    paths = {}
    for line in text.splitlines():
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        paths[f"{number}:{controllers}"] = path
    return paths


def need_for(lane: str, suites: Sequence[str] = (), catalog: Catalog | None = None) -> Need:
    catalog = catalog or load_catalog()
    lane_obj = catalog.lane(lane)
    chosen = [catalog.suite(s, lane_obj.backend) for s in suites] or list(catalog.suites_of_lane(lane))
    return Need(lane, lane_obj.backend, max(s.gpus for s in chosen), tuple(s.name for s in chosen))


def check_vendor(need: Need, env: Mapping[str, str], info=None) -> list[str]:
    """Right vendor, enough visible GPUs, and MILES_HARDWARE_PLATFORM consistent with torch."""
    if need.gpus == 0:
        return []
    from miles.platform import PlatformError, detect, resolve

    info = info if info is not None else detect()
    problems = []
    tools = SMI_TOOLS[need.backend]
    if not any(shutil.which(t, path=env.get("PATH")) for t in tools):
        problems.append(
            f"tools: none of {', '.join(tools)} is on PATH; the {VENDOR[need.backend]} driver tools are missing"
        )
    count = _visible(info.device_count, need.backend, env)
    suites = ", ".join(need.suites)
    if info.platform != need.backend:
        problems.append(
            f"vendor: lane {need.lane} needs {need.gpus} {VENDOR[need.backend]} GPU(s) ({need.backend}) for "
            f"{suites}; this machine is {info.describe()}"
        )
    elif count < need.gpus:
        shown = "".join(f" {n}={env[n]}" for n in VISIBLE_ENV[need.backend] if n in env)
        problems.append(
            f"gpus: {suites} needs {need.gpus} visible GPU(s), {count} visible{shown}; "
            "run on a runner with that many or widen the visible-device variable"
        )
    value = env.get("MILES_HARDWARE_PLATFORM", "").strip()
    if value and value != need.backend:
        problems.append(
            f"platform: MILES_HARDWARE_PLATFORM={value} but lane {need.lane} runs {need.backend}; "
            "unset it or fix the image that sets it"
        )
    elif value:
        try:
            resolve(env, info)
        except PlatformError as exc:
            problems.append(f"platform: {exc}")
    return problems


def _visible(detected: int, backend: str, env: Mapping[str, str]) -> int:
    """Visible devices: torch already honours the variables; vendor tools list the whole host."""
    count = detected
    for name in VISIBLE_ENV[backend]:
        if name in env:
            listed = [d for d in env[name].split(",") if d.strip()]
            count = min(count, len(listed))
    return count


@functools.cache
def python_available(version: str) -> bool:
    """Whether `python<version>` on PATH really runs (a pyenv shim of an unselected version does not)."""
    if "{}.{}".format(*sys.version_info[:2]) == version:
        return True
    exe = shutil.which(f"python{version}")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-c", "pass"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def check_python(lane: str, catalog: Catalog | None = None) -> list[str]:
    version = (catalog or load_catalog()).lane(lane).python
    if python_available(version):
        return []
    return [
        f"python: lane {lane} runs on Python {version}, and no working python{version} is on PATH; "
        f"install it (with pyenv: pyenv install {version} and add it to `pyenv global`)"
    ]


def check_pins(lane: str, installed: Mapping[str, str] | None = None, root: Path | None = None) -> list[str]:
    """The lane's lock against the running interpreter's packages, one line per difference."""
    from miles.ci.machine.stacks import stack_for_lane
    from miles.image.pins import diff_installed, installed_versions, parse_lock

    root = root or ROOT
    stack = stack_for_lane(lane)
    lock = parse_lock(root / stack.lock_path, root=root)
    mismatches = diff_installed(lock, installed if installed is not None else installed_versions())
    # wrong versions say more than missing packages; show them first
    mismatches.sort(key=lambda m: (m.found is None, m.name))
    lines = [f"pins: {m}" for m in mismatches]
    if len(lines) > MAX_PIN_LINES:
        missing = sum(m.found is None for m in mismatches)
        lines = lines[: MAX_PIN_LINES - 1] + [
            f"pins: … and {len(mismatches) - MAX_PIN_LINES + 1} more ({missing} of {len(lock.pins)} "
            f"pins missing in all); this interpreter does not run the {stack.name} stack: install "
            f"{stack.lock_path} (`nox -s {lane}`) or use the image built from it"
        ]
    return lines


def check_disk(path: Path, min_free_gb: float) -> list[str]:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the folder may not exist yet; its filesystem does
    free_gb = shutil.disk_usage(probe).free / 2**30
    if free_gb >= min_free_gb:
        return []
    return [
        f"disk: {free_gb:.1f} GiB free under {path}, the lane needs {min_free_gb:g} GiB for checkpoints; "
        f"free space or point {MODEL_DIR_ENV} elsewhere ({MIN_FREE_ENV} changes the threshold)"
    ]


def find_leftovers(patterns: Iterable[str] = LEFTOVER_PATTERNS, proc: Path = Path("/proc")) -> list[Leftover]:
    """Processes whose command line matches a pattern, except this one and its ancestors,
    whoever they belong to (JobScope says which are this job's)."""
    regex = re.compile("|".join(f"(?:{p})" for p in patterns))
    mine = set(_ancestor_chain(os.getpid(), proc))
    boot = _boot_time(proc)
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        command = _command_line(entry)
        if not command or not regex.search(command):
            continue
        process = _read_process(proc, int(entry.name), boot)
        if process is not None:
            found.append(process)
    return sorted(found, key=lambda p: p.pid)


def _command_line(base: Path) -> str:
    try:
        return (base / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""  # exited while we looked


def _read_process(proc: Path, pid: int, boot: float) -> Leftover | None:
    """A live process's facts, or None when it has exited (or is a zombie, which holds
    nothing but its exit status)."""
    base = proc / str(pid)
    command = _command_line(base)
    try:
        fields = (base / "stat").read_text().rsplit(")", 1)[1].split()
        status = (base / "status").read_text()
        cgroup = (base / "cgroup").read_text()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    uid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:")), -1)
    return Leftover(pid, command, max(0.0, time.time() - started), started, uid, cgroup, _runner_of(base))


def _runner_of(base: Path) -> str | None:
    """RUNNER_NAME in a process's environment: "" when unset, None when it cannot be read."""
    try:
        environ = (base / "environ").read_bytes()
    except OSError:
        return None
    prefix = f"{RUNNER_ENV}=".encode()
    for item in environ.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return ""


def _ancestor_chain(pid: int, proc: Path) -> list[int]:
    """`pid`, its parent, its parent's parent, ... up to the first process."""
    chain: list[int] = []
    while pid > 0 and pid not in chain:
        chain.append(pid)
        try:
            pid = int((proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return chain


def _boot_time(proc: Path) -> float:
    for line in (proc / "stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0


def kill_leftovers(leftovers: Sequence[Leftover], grace_s: float = 5.0) -> list[Leftover]:
    """SIGTERM each, SIGKILL what is still alive after `grace_s`; returns the survivors."""
    for p in leftovers:
        _signal(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    alive = list(leftovers)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p.pid)]
    for p in alive:
        _signal(p.pid, signal.SIGKILL)
    time.sleep(0.05)
    return [p for p in alive if _alive(p.pid)]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def check_leftovers(
    clean: bool, patterns: Iterable[str] = LEFTOVER_PATTERNS, scope: JobScope | None = None
) -> tuple[list[str], list[str]]:
    """(problems, notes): this job's leftovers are problems unless `clean` killed them; another
    job's matching processes are named in a note and never touched."""
    scope = scope if scope is not None else JobScope.current(os.environ)
    ours, notes = [], []
    for p in find_leftovers(patterns):
        why = scope.not_ours(p)
        if why is None:
            ours.append(p)
        else:
            notes.append(f"left alone: {p.describe()}: {why}")
    if not ours:
        return [], notes
    if not clean:
        return [
            f"processes: {p.describe()} is left from an earlier job; rerun with --clean to kill it"
            for p in ours
        ], notes
    survivors = kill_leftovers(ours)
    notes += [f"killed {p.describe()}" for p in ours if p not in survivors]
    return [
        f"processes: {p.describe()} survived SIGKILL; the machine needs attention" for p in survivors
    ], notes


class BadSetting(ValueError):
    """A preflight setting (flag or variable) that is not a value it can use; bad input."""


def free_space_needed(given: float | None, env: Mapping[str, str], backend: str) -> float:
    """GB of free disk the lane needs: --min-free-gb, else $MILES_PREFLIGHT_MIN_FREE_GB, else the
    backend's; a value that is not a finite number of at least 0 is a BadSetting."""
    text = str(given) if given is not None else env.get(MIN_FREE_ENV, "").strip()
    where = "--min-free-gb" if given is not None else MIN_FREE_ENV
    if not text:
        return MIN_FREE_GB[backend]
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise BadSetting(f"{where}={text[:40]!r} must be a number of GB, at least 0")
    return value


def preflight(
    lane: str,
    *,
    suites: Sequence[str] = (),
    machine_only: bool = False,
    clean: bool = False,
    model_dir: Path | None = None,
    min_free_gb: float | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[list[str], list[str]]:
    """Every check for `lane`; returns (problems, notes)."""
    env = os.environ if env is None else env
    need = need_for(lane, suites)
    problems = check_python(lane) + check_vendor(need, env)
    if not machine_only:
        problems += check_pins(lane)
    problems += engine_stack_problems(need, env, machine_only=machine_only)
    threshold = free_space_needed(min_free_gb, env, need.backend)
    problems += check_disk(model_dir or Path(env.get(MODEL_DIR_ENV, ".")).resolve(), threshold)
    if not machine_only and need.gpus:
        problems += transformer_engine_problems(lane)
    leftover_problems, notes = check_leftovers(clean)
    return problems + leftover_problems, notes


def engine_stack_problems(need: Need, env: Mapping[str, str], *, machine_only: bool) -> list[str]:
    """The rollout engine's imports, the GPU architecture against the image's kernels, and the
    driver against the stack (miles.ci.machine.gpu_stack); GPU lanes only."""
    if need.gpus == 0:
        return []
    from miles.ci.machine.gpu_stack import gpu_stack_problems

    return gpu_stack_problems(need.lane, need.backend, env, machine_only=machine_only)


def transformer_engine_problems(lane: str) -> list[str]:
    """Transformer Engine imports at the stack's version and megatron-core uses it (GPU lanes)."""
    from miles.ci.machine.te_preflight import check_transformer_engine

    return check_transformer_engine(lane, ROOT)


@dataclass(frozen=True)
class LaneArgs:
    """A lane session's arguments, split into its own flags and what goes to the runner."""

    plan: bool
    system: bool
    clean: bool
    suites: tuple[str, ...]
    runner: tuple[str, ...]


def split_lane_args(posargs: Sequence[str]) -> LaneArgs:
    """`nox -s <lane> -- …`: --system and --clean are the lane's; the rest go to the runner."""
    runner = [a for a in posargs if a not in ("--system", "--clean")]
    suites = []
    for i, arg in enumerate(runner):
        if arg == "--suite" and i + 1 < len(runner):
            suites.append(runner[i + 1])
        elif arg.startswith("--suite="):
            suites.append(arg.split("=", 1)[1])
    return LaneArgs(
        "--plan" in runner, "--system" in posargs, "--clean" in posargs, tuple(suites), tuple(runner)
    )
