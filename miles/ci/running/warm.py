"""Each test file's pytest process forked from one that has already imported torch, transformers
and megatron-core, instead of a fresh interpreter that imports them again.

A CPU lane starts ~190 pytest processes; most import torch, transformers and megatron-core
before their first test, 3-4 s of CPU each on a 2-core machine (the lane's phase table:
`start`). A runner job of a CPU lane of at least MIN_FILES files therefore keeps one *warm*
process (this module's `main`, started once per job): it imports those libraries and then only
forks. For each attempt the runner sends it the attempt's exact command (`python -m pytest FILE
...`), working directory and environment, with the write end of the output pipe and the
attempt's cgroup (SCM_RIGHTS). The warm process forks; the child starts a session of its own,
enters the cgroup, takes the pipe as stdout and stderr and /dev/null as stdin, takes the
environment and directory (`random` reseeds itself in a forked child), and runs pytest as
`__main__`, as `python -m pytest` would; it exits through the interpreter's normal shutdown
(atexit handlers, non-daemon threads). The warm process reaps it and reports its exit status
and CPU seconds (wait4) to the runner, which treats it as it treats a Popen child
(`WarmProcess`): the same timeout, containment (session, cgroup, process tree) and report.

Only imports are shared, as in miles.train.forked_ranks: nothing in the warm process has run a
torch operator or read a test's environment. An attempt whose interpreter, command or
environment differs from what the warm process was started with (any variable but the runner's
own MILES_CI_*: those are read at run time, never at import) is started the ordinary way, and so
is every attempt when the warm process could not start or died; `MILES_CI_WARM=0` turns it off
(`1` turns it on for any run). GPU lanes never use it: CUDA cannot be forked into; and where a
GPU device node exists megatron-core is not preloaded (importing it asks torch whether CUDA is
there).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ENV = "MILES_CI_WARM"  # "0": every attempt in a fresh interpreter
RUNNER_VARS = "MILES_CI_"  # the runner's per-attempt variables: never read at import
GPU_NODES = ("/dev/nvidiactl", "/dev/kfd")
MAX_MESSAGE = 1 << 20
MIN_FILES = 8
READY_S = 120.0  # the imports, on a loaded 2-core machine


# ------------------------------------------------------------------ the warm process


def preload() -> list[str]:
    """Import what the tests share; a module that fails is left to the tests, which report it.
    miles first: its __init__ makes megatron-core's fusions eager without CUDA (miles.megatron.compat)."""
    done = []
    pinned = os.environ.get("OMP_NUM_THREADS")  # the tests' own setting, read at import
    if pinned not in (None, "1"):
        return done  # a pool of several threads would start here: nothing is preloaded
    try:
        import miles.megatron.compat  # noqa: F401

        done.append("miles")
        # no OpenMP pool to fork: each child sets its threads as a fresh process would (_Child.run)
        from miles.train.fork_server import import_torch_without_a_pool

        import_torch_without_a_pool()
        done.append("torch")
        import transformers.modeling_utils  # noqa: F401

        done.append("transformers")
        import pytest  # noqa: F401

        done.append("pytest")
        if not any(os.path.exists(node) for node in GPU_NODES):
            from miles.megatron import import_model_module

            import_model_module()
            done.append("megatron-core")
    except Exception:  # what is left is imported by the tests that need it, as before
        pass
    return done


class _Child:
    """What a forked child runs: the attempt's pytest command, as `python -m pytest` runs it."""

    def __init__(self, request: dict, fds: list[int], go: int):
        self.request, self.fds, self.go = request, fds, go

    def run(self) -> int:
        os.setsid()
        os.read(self.go, 1)  # the warm process has put it in the attempt's cgroup
        os.close(self.go)
        out = self.fds[0]
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        for fd in {devnull, *self.fds}:
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(self.request["cwd"])
        os.environ.clear()
        os.environ.update(self.request["env"])
        if "torch" in sys.modules:  # the intra-op threads a fresh process starts with
            from miles.train.fork_server import threads_as_fresh

            threads_as_fresh()
        phases = sys.modules.get("miles.phases")
        if phases is not None:
            phases._install()  # the attempt's phase folder, from this process's start (its fork)
        argv = self.request["argv"]
        sys.argv = [argv[2], *argv[3:]]
        sys.path[0] = os.getcwd()
        import runpy

        try:
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                return exc.code or 0
            print(exc.code, file=sys.stderr)
            return 1
        return 0


def serve(sock: socket.socket) -> _Child | None:
    """Fork one child per request until the runner closes the socket; in a child, return what it runs."""
    while True:
        try:
            message, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 4)
        except OSError:
            return None
        if not message:
            return None
        request = json.loads(message)
        go_read, go_write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(go_write)
            sock.close()
            return _Child(request, fds, go_read)
        os.close(go_read)
        moved = False
        if request.get("cgroup") and len(fds) > 1:
            try:
                os.write(fds[1], str(pid).encode())
                moved = True
            except OSError:
                pass
        for fd in fds:
            os.close(fd)
        os.write(go_write, b"x")
        os.close(go_write)
        try:
            sock.send(json.dumps({"pid": pid, "cgroup": moved}).encode())
        except OSError:
            pass
        _, status, usage = os.wait4(pid, 0)
        try:
            sock.send(
                json.dumps({"pid": pid, "status": status, "cpu": usage.ru_utime + usage.ru_stime}).encode()
            )
        except OSError:
            return None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    sock = socket.socket(fileno=int(args[0]))
    from miles.children import die_with

    die_with(int(args[1]))  # the runner job that started it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner handles ^C; the children get their own
    loaded = preload()
    # what the imports made lives as long as the process: out of the collector's sight, a child
    # neither walks it in its collections nor writes to its pages (copy on write) on the way out
    # (a child's exit: 0.89 s without, 0.26 s with)
    gc.collect()
    gc.freeze()
    sock.send(json.dumps({"ready": True, "preloaded": loaded}).encode())
    child = serve(sock)
    if child is None:
        return 0
    return child.run()


# ------------------------------------------------------------------ the runner's side


def _key(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(RUNNER_VARS)}


def _zombie(pid: int) -> bool:
    """Exited, not yet reaped by the warm process (whose report then comes at once)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


class WarmProcess:
    """A forked test process, as the runner uses a Popen: pid, stdout, poll(), wait(), returncode;
    plus `cpu`, its CPU seconds and its reaped descendants' (wait4), once it has exited."""

    def __init__(self, starter: Warm, pid: int, stdout):
        self._starter, self.pid, self.stdout = starter, pid, stdout
        self.returncode: int | None = None
        self.cpu = 0.0

    def _finish(self, message: dict) -> None:
        status = message["status"]
        self.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        self.cpu = float(message["cpu"])

    def poll(self) -> int | None:
        if self.returncode is None:
            message = self._starter._receive(1.0 if _zombie(self.pid) else 0.0)
            if message is not None:
                self._finish(message)
            elif self._starter.dead and not os.path.exists(f"/proc/{self.pid}"):
                self.returncode = -signal.SIGKILL  # the warm process died: its status is lost
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(["pytest"], timeout)
            message = self._starter._receive(left if left is not None else 3600.0)
            if message is not None:
                self._finish(message)
            elif self._starter.dead:
                if self.poll() is None:
                    raise subprocess.TimeoutExpired(["pytest"], timeout or 0.0)
        return self.returncode


class Warm:
    """One warm process for a runner job's attempts (started on first use, before the attempt's
    containment takes its snapshot of the runner's children); None-like when unavailable."""

    def __init__(self, python: str, env: Mapping[str, str], cwd: Path):
        self.python, self.key, self.dead = python, _key(env), False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.proc = subprocess.Popen(
            [python, "-m", "miles.ci.running.warm", str(theirs.fileno()), str(os.getpid())],
            cwd=cwd,
            env=dict(self.key),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
            start_new_session=True,
        )
        theirs.close()
        ready = self._receive(READY_S)
        if not ready or not ready.get("ready"):
            self.close()
            raise OSError("the warm process did not get ready")

    def _receive(self, timeout: float) -> dict | None:
        if self.dead:
            return None
        self.sock.settimeout(max(timeout, 0.0) if timeout else 0.0)
        try:
            data = self.sock.recv(MAX_MESSAGE)
        except (BlockingIOError, TimeoutError):
            return None
        except OSError:
            data = b""
        if not data:
            self.dead = True
            return None
        return json.loads(data)

    def suits(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        return (
            not self.dead
            and self.proc.poll() is None
            and list(argv[:3]) == [self.python, "-m", "pytest"]
            and _key(env) == self.key
        )

    def start(self, argv: Sequence[str], cwd: Path, env: Mapping[str, str], cgroup_fd: int | None):
        """(WarmProcess, whether it entered the cgroup); OSError when the warm process cannot."""
        read, write = os.pipe()
        try:
            request = {"argv": list(argv), "cwd": str(cwd), "env": dict(env), "cgroup": cgroup_fd is not None}
            fds = [write] if cgroup_fd is None else [write, cgroup_fd]
            try:
                socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            except OSError:
                self.dead = True
                raise
        finally:
            os.close(write)
        reply = self._receive(READY_S)
        if reply is None or "pid" not in reply:
            os.close(read)
            self.dead = True
            raise OSError("the warm process did not fork")
        return WarmProcess(self, reply["pid"], os.fdopen(read, "rb", buffering=0)), reply["cgroup"]

    def close(self) -> None:
        self.dead = True
        try:
            self.sock.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


_current: list[Warm] = []
_failed: list[str] = []


def close() -> None:
    """End this process's warm process and fork server now (else at exit): a test that started
    one frees it."""
    while _current:
        _current.pop().close()
    while _servers:
        _servers.pop().close()


def wanted(env: Mapping[str, str], files: int) -> bool:
    """MILES_CI_WARM=1: yes; 0: no; unset: for a run of at least MIN_FILES files (the warm process
    costs about what one file's imports do), unless the runner itself runs inside a test (a
    runner's own tests run small lanes of their own; MILES_CI_WARM=1 asks for it there)."""
    from miles.ci.running.processes import TOKEN_ENV

    setting = env.get(ENV, "")
    if setting not in ("", "0", "1"):
        raise ValueError(f"{ENV}={setting!r}: give 1 (fork test processes from a warm one) or 0 (never)")
    if not hasattr(socket, "send_fds") or setting == "0":
        return False
    return setting == "1" or (TOKEN_ENV not in env and files >= MIN_FILES)


def _held(held: list, failed: list, python: str, env: Mapping[str, str], start, fallback: str):
    """The job's one process of a kind (held[0]) for this interpreter and environment, started now
    (`start()`) if need be; None once it could not start (said once on stderr: `fallback`)."""
    if held and held[0].python == python and held[0].key == _key(env) and not held[0].dead:
        return held[0]
    if failed:
        return None
    while held:
        held.pop().close()
    try:
        process = start()
    except (OSError, ValueError) as exc:
        failed.append(str(exc))
        print(f"warning: {fallback}: {exc}", file=sys.stderr)
        return None
    held.append(process)
    import atexit

    atexit.register(process.close)
    return process


def warm_for(python: str, env: Mapping[str, str], cwd: Path) -> Warm | None:
    """The job's warm process for this interpreter and environment (started now if need be), or
    None: it could not start (said once on stderr; attempts start as before)."""
    fallback = "test processes start in fresh interpreters"
    return _held(_current, _failed, python, env, lambda: Warm(python, env, cwd), fallback)


# ------------------------------------------------------------------ the trainer's fork server


class ForkServer:
    """A job's `python -m miles.train.forked_ranks --serve` (miles.train.fork_server): the CPU
    launches its tests start (`python -m miles.train.forked_ranks ...`, the recipes' CPU command)
    are forked from it instead of importing the trainer again (about 3.5 s of CPU a launch)."""

    def __init__(self, python: str, env: Mapping[str, str], cwd: Path):
        import tempfile

        from miles.train.forked_ranks import SERVER_ENV

        self.python, self.key, self.dead = python, _key(env), False
        self.folder = tempfile.mkdtemp(prefix="miles-fork-")
        self.path = os.path.join(self.folder, "server.sock")
        self.env_name = SERVER_ENV
        self.proc = subprocess.Popen(
            [python, "-m", "miles.train.forked_ranks", "--serve", self.path, "--exit-with", str(os.getpid())],
            cwd=cwd,
            env=dict(self.key),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], READY_S)
        line = self.proc.stdout.readline() if ready else b""
        try:
            ok = json.loads(line).get("ready") == self.path
        except ValueError:
            ok = False
        if not ok:
            self.close()
            raise OSError("the trainer's fork server did not get ready")

    def usage(self) -> float:
        """CPU seconds of the launches it has finished (0.0 when it cannot say)."""
        if self.dead or self.proc.poll() is not None:
            return 0.0
        from miles.train.fork_server import usage

        return usage(self.path) or 0.0

    def close(self) -> None:
        self.dead = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


_servers: list[ForkServer] = []
_server_failed: list[str] = []


def fork_server_for(python: str, env: Mapping[str, str], cwd: Path) -> ForkServer | None:
    """The job's fork server for this interpreter and environment (started now if need be), or
    None: it could not start (said once on stderr; launches import the trainer themselves)."""
    fallback = "CPU launches import the trainer themselves"
    return _held(_servers, _server_failed, python, env, lambda: ForkServer(python, env, cwd), fallback)


if __name__ == "__main__":
    sys.exit(main())
