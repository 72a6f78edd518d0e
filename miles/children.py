"""Helper processes end when the process that started them does, even when it is killed.

megatron-core's checkpoint writer forks one process per write bucket
(`FileSystemWriterAsync.write_preloaded_data_multiproc`, megatron-core 0.16.1) and reports
through a queue served by a manager process it spawns once. A trainer killed by SIGKILL
mid-save runs no cleanup, and those processes, reparented to PID 1, outlive it: a writer
holding a copy of its memory, the manager holding its output pipes open.

`arm()` makes every process this one forks from its main thread ask the kernel for SIGKILL when
this process's main thread ends (Linux `PR_SET_PDEATHSIG`). It acts at fork time
(`os.register_at_fork`), so it covers forks made inside any library. A spawned process (a new
program: multiprocessing's spawn, subprocess) runs no fork hook; one started with
`die_with_parent` as its initializer asks for the same. A fork made from another thread is left
alone, since the death signal follows the forking thread, not the process. Elsewhere than on
Linux both do nothing. Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_armed = False
_parent: tuple[int, bool] | None = None  # (pid, forking from the main thread) at the last fork


def arm() -> None:
    """Forked children of this process's main thread die with it (idempotent; Linux only)."""
    global _armed
    if _armed or not sys.platform.startswith("linux"):
        return
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _armed = True


def _before_fork() -> None:
    global _parent
    _parent = (os.getpid(), threading.current_thread() is threading.main_thread())


def _after_fork_in_child() -> None:
    if _parent is not None and _parent[1]:
        _ask_for_death_signal(_parent[0])


def die_with_parent() -> None:
    """In a process multiprocessing started (an initializer): SIGKILL when its parent ends."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is not None and sys.platform.startswith("linux"):
        _ask_for_death_signal(parent.pid)


def die_with(parent_pid: int) -> None:
    """In a program another process started (subprocess): SIGKILL when the thread of
    `parent_pid` that started it ends (Linux; start such programs from a long-lived thread)."""
    if sys.platform.startswith("linux"):
        _ask_for_death_signal(parent_pid)


def _ask_for_death_signal(parent_pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # the kernel refused; nothing else to do from here
    if os.getppid() != parent_pid:  # the parent died before the request was in place
        os._exit(1)
