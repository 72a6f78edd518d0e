"""Every process a test started, wherever it went, and how to stop them all.

A test's processes can leave its process group and session (`setsid sleep`, a `setsid -f`
daemon, a server started with `start_new_session=True`), so the group alone does not find
them. Two nets catch them:

- a cgroup v2 of the attempt's own, where the cgroup filesystem is mounted and writable: the
  test process enters it before it execs, so every descendant is in it whatever it does;
- always, the runner as a child subreaper (`prctl(PR_SET_CHILD_SUBREAPER)`), so an orphaned
  descendant is re-parented to the runner instead of init, plus a walk of /proc: the test's
  descendants, the orphans adopted during the attempt, the test's group and session, and any
  process whose environment carries the attempt's token.

`Containment.stop()` sends SIGTERM to all of them and waits the grace period. Then it freezes
what is left before killing it: a process that forks and lets its parent exit, over and over,
outruns any kill-what-you-see loop, so every member gets SIGSTOP until two scans in a row
find the same members, all of them already stopped in both, none vanished (a stopped
process cannot fork, and with the runner as subreaper every descendant stays in its tree).
Only then does everything get SIGKILL, and the attempt is gone once several scans in a row
find no member. The freeze is bounded (FREEZE_S); one that ran out (a loaded machine) is
followed by another round, up to KILL_ROUNDS. A member that will not stop (stuck in the
kernel) leaves containment partial, and `escaped` names it. It reaps
the orphans it adopted and says which processes it stopped.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from miles.cgroups import cgroup2_mount, own_cgroup

TOKEN_ENV = "MILES_CI_ATTEMPT_TOKEN"
PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.02
FREEZE_S = 10.0  # how long the freeze may take before containment is called partial
KILL_ROUNDS = 3  # freeze-and-kill rounds while a member is still alive after one
QUIET_SCANS = 3  # scans in a row without a member before the attempt counts as gone


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    sid: int
    start: int  # start time in clock ticks since boot: (pid, start) names one process for good
    state: str = "R"  # the kernel's one-letter state: T (stopped) and t (traced) cannot run

    @property
    def key(self) -> tuple[int, int]:
        return self.pid, self.start

    @property
    def stopped(self) -> bool:
        return self.state in ("T", "t")

    def describe(self) -> str:
        try:
            raw = Path(f"/proc/{self.pid}/cmdline").read_bytes()
        except OSError:
            raw = b""
        cmd = " ".join(part.decode("utf-8", "replace") for part in raw.split(b"\0") if part)
        cmd = cmd or _comm(self.pid)
        return f"pid {self.pid} ({cmd[:120]})"


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _stat(pid: int) -> Proc | None:
    """The live (not zombie) process `pid`, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return Proc(pid, int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]), fields[0].decode())


def process_table(vanished: set[int] | None = None) -> dict[int, Proc]:
    """Every live process; the pids listed but gone by the time they were read are added to
    `vanished` when given."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if entry.isdigit():
            proc = _stat(int(entry))
            if proc is not None:
                table[proc.pid] = proc
            elif vanished is not None and not os.path.exists(f"/proc/{entry}"):
                vanished.add(int(entry))  # gone between the listing and the read (a zombie is not)
    return table


def children_of(pid: int, table: dict[int, Proc] | None = None) -> set[int]:
    table = process_table() if table is None else table
    return {p.pid for p in table.values() if p.ppid == pid}


def _has_token(pid: int, token: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return token in fh.read().split(b"\0")
    except OSError:
        return False


def set_subreaper(on: bool) -> bool:
    """Make this process adopt its orphaned descendants (Linux); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# ---------------------------------------------------------------- cgroup v2


class Cgroup:
    """A cgroup v2 made for one attempt under the runner's own cgroup."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)

    @classmethod
    def create(cls, name: str) -> Cgroup | None:
        """A fresh cgroup, or None where cgroup v2 is absent, read-only or not delegated."""
        mount, own = cgroup2_mount(), own_cgroup()
        if mount is None or own is None:
            return None
        path = mount / own.lstrip("/") / name
        try:
            path.mkdir()
        except OSError:
            return None
        try:
            return cls(path)
        except OSError:
            _rmdir(path)
            return None

    @property
    def fd(self) -> int:
        """cgroup.procs, open for writing (a warm process moves a test process it forked with it)."""
        return self._fd

    def enter(self) -> None:
        """Run in the child between fork and exec: move this very process into the cgroup."""
        os.write(self._fd, b"0")

    def pids(self) -> set[int]:
        try:
            text = (self.path / "cgroup.procs").read_text()
        except OSError:
            return set()
        return {int(x) for x in text.split()}

    def kill(self) -> None:
        try:
            (self.path / "cgroup.kill").write_text("1")  # kernel 5.14+: every member at once
        except OSError:
            for pid in self.pids():
                _signal(pid, signal.SIGKILL)

    def remove(self) -> None:
        os.close(self._fd)
        deadline = time.monotonic() + 2
        while not _rmdir(self.path) and time.monotonic() < deadline:
            time.sleep(_POLL_S)


def _rmdir(path: Path) -> bool:
    try:
        path.rmdir()
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------- one attempt


class Containment:
    """Tracks the processes of one attempt from before it starts until they are all gone."""

    def __init__(self, *, use_cgroup: bool = True):
        self.token = uuid.uuid4().hex
        self.runner = os.getpid()
        self.cgroup = Cgroup.create(f"miles-ci-{self.runner}-{self.token[:12]}") if use_cgroup else None
        self.subreaper = set_subreaper(True)
        self.before = children_of(self.runner)  # the runner's children that are not the test's
        self.root: int | None = None
        self.killed: dict[tuple[int, int], str] = {}
        self.escaped: tuple[str, ...] = ()  # members still alive after stop(): containment was partial

    @property
    def method(self) -> str:
        nets = ["cgroup" if self.cgroup else "", "subreaper" if self.subreaper else "", "/proc"]
        return "+".join(n for n in nets if n)

    def drop_cgroup(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None

    def env(self) -> dict[str, str]:
        return {TOKEN_ENV: self.token}

    def preexec(self) -> Callable[[], None] | None:
        return self.cgroup.enter if self.cgroup else None

    def started(self, pid: int) -> None:
        self.root = pid

    def members(self, table: dict[int, Proc] | None = None) -> dict[int, Proc]:
        """Every live process of the attempt (the runner and its ancestors never count)."""
        table = process_table() if table is None else table
        excluded = _ancestors(self.runner, table) | {self.runner}
        roots: set[int] = set()
        if self.root is not None:
            roots.add(self.root)
        roots |= {p.pid for p in table.values() if p.ppid == self.runner and p.pid not in self.before}
        if self.cgroup is not None:
            roots |= self.cgroup.pids()
        token = f"{TOKEN_ENV}={self.token}".encode()
        for p in table.values():
            if self.root is not None and (p.pgid == self.root or p.sid == self.root):
                roots.add(p.pid)
            elif p.pid not in roots and p.pid not in excluded and _has_token(p.pid, token):
                roots.add(p.pid)
        found = {pid for pid in roots if pid in table} - excluded
        children: dict[int, list[int]] = {}
        for p in table.values():
            children.setdefault(p.ppid, []).append(p.pid)
        stack = list(found)
        while stack:  # and everything below them
            for child in children.get(stack.pop(), ()):
                if child not in found and child not in excluded:
                    found.add(child)
                    stack.append(child)
        return {pid: table[pid] for pid in found}

    def signal_all(self, sig: int) -> dict[int, Proc]:
        members = self.members()
        for proc in members.values():
            if sig == signal.SIGKILL or proc.pid != self.root:
                self.killed.setdefault((proc.pid, proc.start), proc.describe())
            _signal(proc.pid, sig)
        return members

    def stop(self, grace: float, hurry: Callable[[], bool] = lambda: False) -> tuple[str, ...]:
        """SIGTERM every member, up to `grace` seconds for them to go, then freeze and SIGKILL
        the rest; returns what it stopped (the test process itself is named only if it had to
        be killed). Leaves no member alive unless one is stuck in the kernel, which `escaped`
        then names."""
        termed = self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        seen = {p.key for p in termed.values()}
        while termed and time.monotonic() < deadline and not hurry():
            self._reap()
            members = self.members()
            if not members:
                break
            for proc in members.values():  # one forked after the SIGTERM went out gets its own
                if proc.key not in seen:
                    seen.add(proc.key)
                    _signal(proc.pid, signal.SIGTERM)
            time.sleep(_POLL_S)
        for _ in range(KILL_ROUNDS):  # a freeze cut short by FREEZE_S (a loaded machine) goes again
            frozen = self._freeze()
            if self.cgroup is not None:
                self.cgroup.kill()
            for proc in frozen.values():
                self.killed.setdefault(proc.key, proc.describe())
                _signal(proc.pid, signal.SIGKILL)
            self._wait_gone(frozen)
            self._reap()
            if not self.escaped:
                break
        return tuple(self.killed.values())

    def _freeze(self) -> dict[int, Proc]:
        """SIGSTOP every member until none can run or fork any more; returns the members, all
        stopped, or those found when FREEZE_S ran out.

        Done means two scans in a row found the same members, every one already stopped in
        both (a stopped process cannot fork), and no process that the earlier scan had not
        seen came and went during the later one (it could have forked before it went).
        Between scans, quick passes over the runner's own process tree stop a process that
        forks and exits faster than a scan of /proc."""
        deadline = time.monotonic() + FREEZE_S
        previous: set[tuple[int, int]] | None = None
        known: set[int] = set()
        while True:
            self._stop_tree()
            vanished: set[int] = set()
            table = process_table(vanished)
            members = self.members(table)
            keys = {p.key for p in members.values()}
            running = [p for p in members.values() if not p.stopped]
            for proc in running:
                _signal(proc.pid, signal.SIGSTOP)
            if (not running and keys == previous and not vanished - known) or time.monotonic() >= deadline:
                return members
            previous = None if running else keys
            known = set(table) | vanished
            self._reap()

    def _stop_tree(self, passes: int = 200) -> None:
        """SIGSTOP every process under the runner (its children but those it had before the
        attempt, theirs, ...), read from /proc/<pid>/task/<tid>/children, again and again
        until a pass finds the same processes as the one before; reaps adopted zombies."""
        last: set[int] | None = None
        for _ in range(passes):
            found: set[int] = set()
            stack = [p for p in _children(self.runner) if p not in self.before]
            if not stack and not _children_supported():
                return
            while stack:
                pid = stack.pop()
                if pid in found:
                    continue
                found.add(pid)
                _signal(pid, signal.SIGSTOP)
                stack.extend(_children(pid))
            for pid in found - {self.root}:
                if _parent(pid) == self.runner:
                    try:
                        os.waitpid(pid, os.WNOHANG)  # an exited hopper: reaped, gone from the list
                    except ChildProcessError:
                        pass
            if found == last:
                return
            last = found

    def _wait_gone(self, killed: dict[int, Proc]) -> None:
        """Wait (bounded) for the SIGKILLed members to die; name those that do not. Gone means
        QUIET_SCANS scans in a row found no member: one scan of /proc can miss a process that
        forked while the scan went by."""
        deadline = time.monotonic() + 5
        left = dict(killed)
        quiet = 0
        while quiet < QUIET_SCANS and time.monotonic() < deadline:
            self._reap()
            table = process_table()
            left = {pid: p for pid, p in left.items() if pid in table and table[pid].start == p.start}
            left.update({pid: p for pid, p in self.members(table).items() if pid not in left})
            for proc in left.values():
                _signal(proc.pid, signal.SIGKILL)
            quiet = 0 if left else quiet + 1
            time.sleep(_POLL_S)
        self.escaped = tuple(p.describe() for p in left.values()) if quiet < QUIET_SCANS else ()

    def _reap(self) -> None:
        """Collect the exit status of orphans this runner adopted (never of its own Popen
        children, which their Popen objects reap)."""
        for pid in _zombie_children(self.runner) - self.before - {self.root}:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def close(self) -> None:
        self._reap()
        if self.subreaper:
            set_subreaper(False)
        if self.cgroup is not None:
            self.cgroup.remove()


def _children(pid: int) -> list[int]:
    """The children of every thread of `pid` (the kernel's list, exact once they are stopped)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                found.extend(int(x) for x in fh.read().split())
        except OSError:
            continue
    return found


def _children_supported() -> bool:
    return os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    return int(raw[raw.rfind(b")") + 2 :].split()[1])


def _ancestors(pid: int, table: dict[int, Proc]) -> set[int]:
    seen: set[int] = set()
    while pid in table and pid not in seen:
        seen.add(pid)
        pid = table[pid].ppid
    return seen


def _zombie_children(parent: int) -> set[int]:
    found = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                raw = fh.read()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()
        if fields[0] == b"Z" and int(fields[1]) == parent:
            found.add(int(entry))
    return found
