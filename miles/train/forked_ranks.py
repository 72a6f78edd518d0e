"""One node's CPU ranks, forked from a process that has already imported what they all import.

    python -m miles.train.forked_ranks --nproc-per-node N [--preload MODULE ...] -m MODULE [ARGS ...]
    python -m miles.train.forked_ranks --nproc-per-node N [--preload MODULE ...] SCRIPT [ARGS ...]

A rank of the trainer spends most of a short CPU run importing torch, transformers and
megatron-core (about 20 s of CPU each, measured with `-X importtime`; a two-rank run under
`torch.distributed.run` pays it three times, once in the launcher). Here the launcher imports
them once, then forks the ranks: each gets the torchrun environment (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT on a free local port) and runs
the module or script as `__main__`, exactly as it would in a fresh interpreter. Only imports are
shared: nothing has run a torch operator, started a thread pool or joined a process group before
the fork (the preload is imports only, with OMP_NUM_THREADS as the caller set it).

Like torchrun: the first rank to fail ends the others (SIGTERM, then SIGKILL after a grace
period) and its exit status is the launcher's (128 + the signal for a rank killed by one);
SIGINT, SIGTERM and SIGHUP sent to the launcher go to every rank. Unlike torchrun: one node only,
no restarts, POSIX only (fork). GPU lanes keep torchrun: CUDA cannot be forked into.

With MILES_FORK_SERVER=SOCKET in its environment the launcher has a fork server (started with
`--serve SOCKET`, miles.train.fork_server) that has imported all this already run the launch
for it, and forks the ranks itself only where the server refuses (it says why).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

GRACE_S = 30.0
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
TRAINER = "miles.train"
SERVER_ENV = "MILES_FORK_SERVER"  # a fork server's socket (miles.train.fork_server)


class LaunchRefused(ValueError):
    """The command line cannot start ranks here; says why and the fix."""


def _split(argv: list[str]) -> int:
    """Where the launcher's options end and the program (`-m MODULE` or SCRIPT) begins."""
    # an option's value is not the program: skip the values of the options that take one
    i = 0
    while i < len(argv):
        if argv[i] in ("--nproc-per-node", "--preload", "--serve", "--exit-with"):
            i += 2
            continue
        if argv[i] == "-m" or not argv[i].startswith("-"):
            break
        i += 1
    return i


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The launcher's options, then `-m MODULE` or SCRIPT; everything after that is the program's."""
    argv = list(argv)
    split = _split(argv)
    p = argparse.ArgumentParser(
        prog="python -m miles.train.forked_ranks",
        description="Start one node's CPU ranks by fork, after importing what they share.",
    )
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks on this node")
    p.add_argument("--preload", action="append", default=[], help="a module to import before the fork")
    args = p.parse_args(argv[:split])
    program = argv[split:]
    if args.nproc_per_node < 1:
        raise LaunchRefused(f"--nproc-per-node {args.nproc_per_node}: give at least 1 rank")
    if not program or program == ["-m"]:
        raise LaunchRefused("no program: give -m MODULE or a SCRIPT path, then its arguments")
    if program[0] == "-m":
        args.module, args.script, args.args = program[1], None, program[2:]
    else:
        if not Path(program[0]).is_file():
            raise LaunchRefused(f"{program[0]}: no such script; give -m MODULE or an existing file")
        args.module, args.script, args.args = None, program[0], program[1:]
    if not hasattr(os, "fork"):
        raise LaunchRefused(
            "this platform has no fork(); start the ranks with python -m torch.distributed.run"
        )
    return args


def trainer_preloads(argv: Sequence[str]) -> list[str]:
    """What every rank of `python -m miles.train ARGV` imports before its first step: the trainer,
    its backend, and transformers' modeling module of the checkpoint's model type (config.json)."""
    mods = ["miles.train.trainer", "miles.train.backends.torch_dp", "transformers"]
    args = list(argv)
    if _value(args, "--train-backend") == "megatron":
        from miles.megatron import MODEL_MODULE

        mods += ["miles.train.backends.megatron", MODEL_MODULE]
    hf = _value(args, "--hf-checkpoint")
    if hf:
        try:
            model_type = json.loads((Path(hf) / "config.json").read_text())["model_type"]
        except (OSError, ValueError, KeyError, TypeError):
            model_type = None  # the trainer itself names what is wrong with the checkpoint
        if isinstance(model_type, str) and model_type.isidentifier():
            mods.append(f"transformers.models.{model_type}.modeling_{model_type}")
    return mods


def _value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def preload(modules: Sequence[str]) -> None:
    """Import each module; one that fails is left to the ranks, which report it as they would."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # the rank's own import raises it again, with its context
            pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }  # fmt: skip


def _run_rank(args: argparse.Namespace, rank: int, port: int) -> None:
    """The child: the rank's environment, then the program as __main__; never returns."""
    code = 1
    try:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        os.environ.update(rank_environment(rank, args.nproc_per_node, port))
        if args.module:
            sys.argv = [args.module, *args.args]
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [args.script, *args.args]
            sys.path[0] = str(Path(args.script).resolve().parent)
            runpy.run_path(args.script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # the rank's traceback, as python would print it
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _status(wait_status: int) -> int:
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def launch(args: argparse.Namespace, watch=None) -> int:
    """Preload, fork the ranks, wait for them; `watch` is the fork server's connection to the
    launcher this launch runs for (miles.train.fork_server)."""
    preload([*args.preload, *(trainer_preloads(args.args) if args.module == TRAINER else [])])
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}
    for rank in range(args.nproc_per_node):
        pid = os.fork()
        if pid == 0:
            _run_rank(args, rank, port)
        ranks[pid] = rank

    def forward(sig, _frame):
        for pid in ranks:
            _signal(pid, sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    if watch is not None:
        from miles.train.fork_server import watch as watch_launcher

        watch_launcher(watch, forward, list(ranks))
    result, deadline = 0, None
    while ranks:
        if deadline is not None and time.monotonic() > deadline:
            for pid in ranks:
                _signal(pid, signal.SIGKILL)
            deadline = None
        pid, wait_status = os.waitpid(-1, os.WNOHANG if deadline is not None else 0)
        if pid == 0:
            time.sleep(0.2)
            continue
        rank = ranks.pop(pid, None)
        if rank is None:
            continue
        code = _status(wait_status)
        if code != 0 and result == 0:
            result = code
            print(
                f"miles.train.forked_ranks: rank {rank} (pid {pid}) exited with {code}; "
                f"stopping the other {len(ranks)}",
                file=sys.stderr,
                flush=True,
            )
            for other in ranks:
                _signal(other, signal.SIGTERM)
            deadline = time.monotonic() + GRACE_S
    return result


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def parse_serve(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m miles.train.forked_ranks --serve",
        description="Import the trainer once and run launches sent by launchers that find "
        f"{SERVER_ENV}=SOCKET in their environment (miles.train.fork_server).",
    )
    p.add_argument("--serve", required=True, metavar="SOCKET", help="the Unix socket to listen on")
    p.add_argument("--preload", action="append", default=[], help="a module to import before serving")
    p.add_argument("--exit-with", type=int, metavar="PID", help="stop when process PID ends")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--serve" in argv[: _split(argv)]:  # a program's own --serve is the program's
        from miles.train.fork_server import serve

        options = parse_serve(argv)
        return serve(options.serve, options.preload, options.exit_with)
    try:
        args = parse(argv)
    except LaunchRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = os.environ.get(SERVER_ENV)
    if server:
        from miles.train.fork_server import launch_remote

        code = launch_remote(server, argv)
        if code is not None:
            return code
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
