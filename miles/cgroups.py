"""Where this process sits in cgroup v2: the hierarchy's mount point and the process's own cgroup.

Standard library only: the CI runner's containment (miles.ci.running.processes) makes a cgroup per
attempt under its own, and the trainer's fork server (miles.train.fork_server) puts a launch it
runs into its launcher's.
"""

from __future__ import annotations

from pathlib import Path


def cgroup2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified beside
    v1 controllers), or None without one."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        pre, _, post = line.partition(" - ")
        if post.split(" ", 1)[0] == "cgroup2":
            return Path(pre.split()[4])
    return None


def own_cgroup(pid: int | str = "self") -> str | None:
    """The v2 cgroup of `pid` (this process by default) as /proc shows it, or None."""
    try:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return line[3:].strip()
    except OSError:
        pass
    return None


def procs_file(cgroup: str) -> Path | None:
    """The cgroup.procs file of `cgroup` (a path as own_cgroup gives it), or None without cgroup v2."""
    mount = cgroup2_mount()
    return None if mount is None else mount / cgroup.lstrip("/") / "cgroup.procs"
