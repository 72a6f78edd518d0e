"""A process that has imported the trainer once and forks launches of `python -m miles.train.forked_ranks` on request.

    python -m miles.train.forked_ranks --serve SOCKET [--preload MODULE ...] [--exit-with PID]
    MILES_FORK_SERVER=SOCKET python -m miles.train.forked_ranks --nproc-per-node N -m miles.train ...

A CPU launch spends its first seconds importing torch, transformers, megatron-core and the
trainer (about 3 s of CPU on a 2-core machine, before the ranks do any work). A machine that
starts many short CPU runs (a CI lane: miles.ci's runner starts one server per job) can keep one
server that has imported them; a launcher that finds `MILES_FORK_SERVER` in its environment then
imports nothing heavy: it sends the server its command line, working directory, environment,
umask, stdin/stdout/stderr and (where it can open it) its cgroup's `cgroup.procs`, and the server
forks a child that takes all of them, enters the cgroup, and runs the launch exactly as the
launcher would have (forked_ranks.launch: the same preloads, fork of the ranks, first failure
ending the others). The launcher stays in its place for its caller: it passes SIGINT, SIGTERM
and SIGHUP on, returns the launch's exit status, and when it dies its launch is killed (the
child watches the connection).

Only imports are shared: the server has run no torch operator, and it serves only a launcher
whose environment could not have changed them. Its interpreter, `sys.path` and every variable
must be the server's own, except those read only at run time (MILES_*, NCCL_*,
TORCHINDUCTOR_CACHE_DIR, and NVTE_*/SGLANG_*/RAY_* while their package is not imported) and a
shell's bookkeeping (SHLVL and the like); PYTHONUNBUFFERED is honoured by opening stdout and stderr
again as the interpreter would have, and OMP_NUM_THREADS by setting torch's threads as its import
would have (the server imports torch with one, so that no thread pool is forked). Anything else is refused with the names that differ, and
the launcher forks its ranks itself, as without a server (it says why on stderr). What still
differs from a fresh launcher: `sys.flags`, resource limits and the parent process id are the
server's, and the launch's CPU time is the server's children's (`usage` requests report it).
"""

from __future__ import annotations

import gc
import io
import json
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Mapping, Sequence

from miles.cgroups import own_cgroup, procs_file
from miles.train.forked_ranks import FORWARDED

MAX_MESSAGE = 1 << 20
# variables read only when used, never by an import: a launcher may set them otherwise (Transformer
# Engine's, sglang's and Ray's while their package is not imported in the server); megatron-core
# sets NVTE_* when it builds a model and torch TORCHINDUCTOR_CACHE_DIR when it first asks for it,
# so a caller that built a model has them
RUNTIME_PREFIXES = {
    "MILES_": None, "NCCL_": None, "NVTE_": "transformer_engine", "SGLANG_": "sglang", "RAY_": "ray",
    "PYTEST_": "pytest",  # PYTEST_CURRENT_TEST and PYTEST_VERSION, set by a calling test
}  # fmt: skip
# cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it makes a handle (deterministic runs set it)
RUNTIME_NAMES = {"TORCHINDUCTOR_CACHE_DIR", "CUBLAS_WORKSPACE_CONFIG"}
UNBUFFERED = "PYTHONUNBUFFERED"
THREADS = "OMP_NUM_THREADS"  # read by torch's import; the server imports it with 1 and sets each launch's
SHELL_BOOKKEEPING = {
    "_",
    "SHLVL",
    "PWD",
    "OLDPWD",
    "COLUMNS",
    "LINES",
}  # a shell's own and the terminal size: read by no import
POLL_S = 1.0


def differences(ours: Mapping[str, str], theirs: Mapping[str, str]) -> list[str]:
    """The variables a launcher's environment sets otherwise than the server's and that an import
    may read: everything but RUNTIME_PREFIXES (whose package is not imported), RUNTIME_NAMES, a
    shell's bookkeeping, and the two a launch sets for itself (PYTHONUNBUFFERED, OMP_NUM_THREADS)."""
    allowed = tuple(
        p for p, module in RUNTIME_PREFIXES.items() if module is None or module not in sys.modules
    )
    return sorted(
        k
        for k in set(ours) | set(theirs)
        if ours.get(k) != theirs.get(k)
        and not k.startswith(allowed)
        and k not in (UNBUFFERED, THREADS)
        and k not in SHELL_BOOKKEEPING
        and k not in RUNTIME_NAMES
    )


# ------------------------------------------------------------------ the server


def serve(path: str, preloads: Sequence[str], exit_with: int | None = None) -> int:
    from miles.train import forked_ranks

    if exit_with is not None:
        from miles.children import die_with

        die_with(exit_with)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # whoever started it stops it (SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _start_path[:] = sys.path  # imports may add to it (setuptools' vendored packages)
    try:
        import_torch_without_a_pool()
    except ImportError:
        pass  # a launch that needs torch says so itself
    forked_ranks.preload([*forked_ranks.trainer_preloads([]), *preloads])
    gc.collect()
    gc.freeze()  # the imports live as long as the server: a launch neither walks nor copies them
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    old = os.umask(0o077)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(16)
    # a launch that ends wakes the loop (SIGCHLD through a pipe), which reaps it and only then tells
    # its launcher its status: what the launch used is in the server's CPU by the time anyone asks
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    print(json.dumps({"ready": path, "pid": os.getpid()}), flush=True)
    try:
        while True:
            ready, _, _ = select.select([listener, wake_read], [], [], POLL_S)
            if wake_read in ready:
                while True:
                    try:
                        if not os.read(wake_read, 512):
                            break
                    except BlockingIOError:
                        break
            _reap()
            if listener not in ready:
                continue
            conn, _ = listener.accept()
            child = _handle(conn)
            if child is not None:  # the forked launch: never returns to the loop
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_read, wake_write):
                    os.close(fd)
                for other in _launches.values():
                    other.close()
                listener.close()
                os._exit(child.run())
            if not any(held is conn for held in _launches.values()):  # a launch's stays open
                conn.close()
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


_start_path: list[str] = []  # the server's sys.path before its imports: a launcher's before its own


_launches: dict[int, socket.socket] = {}  # running launch -> its launcher's connection


def _reap() -> None:
    """Reap the launches that ended and send each launcher its launch's exit status."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = _launches.pop(pid, None)
        if conn is None:
            continue
        code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        try:
            conn.send(json.dumps({"exit": code}).encode())
        except OSError:
            pass
        conn.close()


def _handle(conn: socket.socket) -> _Launch | None:
    """One request: a usage query, or a launch to fork (returned in the child)."""
    fds: list[int] = []
    child = None
    try:
        conn.settimeout(10.0)
        message, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE, 4)
        request = json.loads(message)
        if request.get("usage"):
            import resource

            _reap()
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            conn.send(json.dumps({"cpu": usage.ru_utime + usage.ru_stime}).encode())
            return None
        refusal = _refusal(request, fds)
        if refusal:
            conn.send(json.dumps({"refused": refusal}).encode())
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            conn.settimeout(None)
            child = _Launch(request, fds, conn)
            return child
        conn.send(json.dumps({"started": pid}).encode())
        _launches[pid] = conn
        # the next launch of this model finds its modeling module here too
        from miles.train import forked_ranks

        forked_ranks.preload(forked_ranks.trainer_preloads(request["argv"]))
        gc.freeze()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        try:
            conn.send(json.dumps({"refused": f"bad request: {exc}"}).encode())
        except OSError:
            pass
    finally:
        if child is None:
            for fd in fds:
                os.close(fd)
    return None


def _refusal(request: dict, fds: list[int]) -> str:
    if request.get("executable") != sys.executable:
        return f"interpreter {request.get('executable')} (the server runs {sys.executable})"
    if request.get("path") != _start_path:
        return "sys.path differs from the server's (another working directory or PYTHONPATH)"
    differ = differences(dict(os.environ), request.get("env") or {})
    if differ:
        return (
            "environment differs from the server's in "
            + ", ".join(differ[:8])
            + (f" and {len(differ) - 8} more" if len(differ) > 8 else "")
        )
    if len(fds) < 3:
        return "stdin, stdout and stderr not passed"
    if len(fds) < 4 and request.get("cgroup") != own_cgroup():
        return "cannot enter the launcher's cgroup (its cgroup.procs could not be opened)"
    return ""


class _Launch:
    """The forked child: the launcher's state, then forked_ranks.launch; its status goes back."""

    def __init__(self, request: dict, fds: list[int], conn: socket.socket):
        self.request, self.fds, self.conn = request, fds, conn

    def run(self) -> int:
        code = 1
        try:
            if len(self.fds) > 3:
                os.write(self.fds[3], str(os.getpid()).encode())  # the launcher's cgroup first
            os.setsid()
            for target, fd in enumerate(self.fds[:3]):
                os.dup2(fd, target)
            for fd in set(self.fds):
                if fd > 2:
                    os.close(fd)
            os.chdir(self.request["cwd"])
            os.umask(int(self.request["umask"]))
            os.environ.clear()
            os.environ.update(self.request["env"])
            _reopen_stdio(bool(os.environ.get(UNBUFFERED)))
            threads_as_fresh()
            sys.argv = list(self.request["sys_argv"])
            sys.orig_argv = list(self.request["orig_argv"])
            for sig in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            phases = sys.modules.get("miles.phases")
            if phases is not None:
                phases._install()  # the caller's phase folder, from this process's start (its fork)
            from miles.train import forked_ranks

            args = forked_ranks.parse(self.request["argv"])
            code = forked_ranks.launch(args, watch=self.conn)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
        return code  # the server reaps this process and sends its status


def import_torch_without_a_pool() -> None:
    """Import torch with one OpenMP thread, the environment left as it was. torch's import runs an
    OpenMP parallel region, which starts the pool's threads, and a forked child cannot use an
    inherited pool well (measured: a test beside a busy process spun 98 s of CPU where a fresh one
    took 21); one thread at import starts none, and each child then sets what its own environment
    asks for (threads_as_fresh). Used here and by the CI runner's warm process."""
    pinned = os.environ.get(THREADS)
    os.environ[THREADS] = "1"
    try:
        import torch  # noqa: F401
    finally:
        if pinned is None:
            del os.environ[THREADS]
        else:
            os.environ[THREADS] = pinned


def threads_as_fresh() -> None:
    """torch's intra-op threads as a fresh import under this environment sets them: OMP_NUM_THREADS
    when it is a positive number, else one per usable CPU (what torch's import chose on these
    machines; tests/unit/test_fork_server.py and tests/unit/test_runner_warm.py compare)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    value = os.environ.get(THREADS, "")
    count = int(value) if value.isdigit() and int(value) > 0 else len(os.sched_getaffinity(0))
    torch.set_num_threads(count)


def _reopen_stdio(unbuffered: bool) -> None:
    """stdout and stderr as the interpreter opens them for this setting of PYTHONUNBUFFERED
    (CPython's create_stdio: unbuffered writes through; buffered, stderr and a tty line-buffer)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        try:
            old.flush()
        except (OSError, ValueError):
            pass
        buf = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
        raw = buf if unbuffered else buf.raw
        raw.name = f"<{name}>"
        line = not unbuffered and (raw.isatty() or fd == 2)
        stream = io.TextIOWrapper(
            buf, encoding=old.encoding, errors=old.errors, newline="\n",
            line_buffering=line, write_through=unbuffered,
        )  # fmt: skip
        stream.mode = "w"
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def watch(conn: socket.socket, forward, ranks: Sequence[int]) -> None:
    """In the forked launch, after its ranks are forked: a signal the launcher passes on goes to
    `forward`; the launcher's end of the connection closing (it died) kills the ranks and this
    process."""

    def loop():
        while True:
            try:
                data = conn.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                for pid in ranks:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os._exit(128 + signal.SIGKILL)
            try:
                forward(int(json.loads(data)["signal"]), None)
            except (ValueError, KeyError, TypeError):
                pass

    threading.Thread(target=loop, daemon=True, name="fork-server-watch").start()


# ------------------------------------------------------------------ the launcher's side


def launch_remote(path: str, argv: Sequence[str]) -> int | None:
    """Run the launch `argv` (forked_ranks' arguments) in the server at `path`: its exit status,
    or None when the server cannot take it (said on stderr; the caller launches itself)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    cgroup_fd = None
    try:
        conn.settimeout(30.0)
        conn.connect(path)
        cgroup = own_cgroup()
        procs = procs_file(cgroup) if cgroup is not None else None
        if procs is not None:
            try:
                cgroup_fd = os.open(procs, os.O_WRONLY | os.O_CLOEXEC)
            except OSError:
                cgroup_fd = None
        umask = os.umask(0)
        os.umask(umask)
        request = {
            "argv": list(argv), "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask,
            "executable": sys.executable, "path": sys.path, "sys_argv": sys.argv, "orig_argv": sys.orig_argv,
            "cgroup": cgroup,
        }  # fmt: skip
        fds = [0, 1, 2] + ([cgroup_fd] if cgroup_fd is not None else [])
        sys.stdout.flush()
        sys.stderr.flush()
        socket.send_fds(conn, [json.dumps(request).encode()], fds)
        reply = json.loads(conn.recv(MAX_MESSAGE) or b"{}")
    except (OSError, ValueError) as exc:
        conn.close()
        print(f"miles.train.forked_ranks: fork server {path} not used ({exc}); forking here", file=sys.stderr)
        return None
    finally:
        if cgroup_fd is not None:
            os.close(cgroup_fd)
    if "started" not in reply:
        conn.close()
        why = reply.get("refused", "no answer")
        print(f"miles.train.forked_ranks: fork server {path} not used: {why}; forking here", file=sys.stderr)
        return None
    conn.settimeout(None)

    def forward(sig, _frame):
        try:
            conn.send(json.dumps({"signal": int(sig)}).encode())
        except OSError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            data = conn.recv(MAX_MESSAGE)
        except InterruptedError:
            continue
        except OSError:
            data = b""
        if not data:
            print(
                f"miles.train.forked_ranks: the server's launch (pid {reply['started']}) ended without a status",
                file=sys.stderr,
            )
            return 1
        message = json.loads(data)
        if "exit" in message:
            return int(message["exit"])


def usage(path: str, timeout: float = 10.0) -> float | None:
    """CPU seconds of the server's finished launches (its reaped children), or None."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(timeout)
            conn.connect(path)
            socket.send_fds(conn, [json.dumps({"usage": True}).encode()], [])
            return float(json.loads(conn.recv(MAX_MESSAGE))["cpu"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
