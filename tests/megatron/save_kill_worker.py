"""Kill Megatron trainers with SIGKILL in the middle of a checkpoint save; report what outlives them.

Not a test module: tests/megatron/test_megatron_save_kill.py runs it as

    python save_kill_worker.py TRIALS WORKDIR

It makes a tiny Qwen3 checkpoint and its torch_dist in WORKDIR, imports the trainer once, then forks trainer processes, AT_ONCE at a time, each building the
Megatron backend from the flags (a world of one, as `python -m miles.train` run directly) and
saving through the trainer's own path (miles.train.checkpoint.save) again and again. Once a
trainer's first save is done (the writer's queue manager is running) and a process of a later
save has appeared (megatron-core's forked writer), it gets SIGKILL. Every process seen below
the trainers must be gone within GRACE seconds of the last kill. Prints one JSON line: the trials, how many were killed
with a writer alive, and the survivors (each killed here afterwards, so nothing is left over).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

GRACE = 3.0
AT_ONCE = 4  # trainers started together (each its own world of one)


def descendants(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                kids = Path(f"/proc/{current}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for kid in map(int, kids):
                if kid not in found:
                    found.add(kid)
                    todo.append(kid)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def trainer(argv: list[str], root: Path) -> None:
    """The forked trainer: the backend the flags ask for, saving until it is killed."""
    from miles.train import checkpoint
    from miles.train.args import parse_config
    from miles.train.backends import make_backend
    from miles.train.distributed import barrier, init_distributed

    config = parse_config(argv)
    backend = make_backend(config, init_distributed(config.job.distributed_backend))
    for done in range(1, 10_000):
        checkpoint.save(backend, root, checkpoint.state_of(config, done), is_main=True, barrier=barrier)
        (root / "saved").write_text(str(done))


def start(argv: list[str], root: Path) -> int:
    """Fork a trainer saving into `root`; its output goes nowhere (a survivor must not hold ours)."""
    pid = os.fork()
    if pid == 0:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        try:
            trainer(argv, root)
        finally:
            os._exit(1)
    return pid


def kill_mid_save(trainers: dict[int, Path]) -> tuple[int, list[str]]:
    """SIGKILL each trainer once its first save is done and a process of a later save is alive;
    returns how many were killed that way and the processes alive GRACE seconds after."""
    deadline = time.monotonic() + 180
    before: dict[int, set[int]] = {}  # the processes each trainer had after its first save
    seen: set[int] = set()
    mid_save = 0
    running = dict(trainers)
    while running:
        if time.monotonic() > deadline:
            raise SystemExit(f"trainers {sorted(running)} did not reach a second save in time")
        for pid, root in list(running.items()):
            if os.waitpid(pid, os.WNOHANG)[0]:
                raise SystemExit(f"the trainer saving into {root} ended before it was killed")
            if pid not in before:
                if (root / "saved").exists():
                    before[pid] = descendants(pid)  # the writer queue's manager
                    seen |= before[pid]
                continue
            current = descendants(pid)
            seen |= current
            if current - before[pid]:  # a writer of the next save
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                mid_save += 1
                del running[pid]
        time.sleep(0.0005)
    end = time.monotonic() + GRACE
    left = [p for p in seen if alive(p)]
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = [p for p in seen if alive(p)]
    found = [f"{p} ({kind(p)})" for p in sorted(left)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    return mid_save, found


def kind(pid: int) -> str:
    """'spawned' (a new program: multiprocessing's spawn) or 'forked' (a copy of the trainer)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "gone"
    return "spawned" if b"spawn_main" in cmdline else "forked"


def tiny_megatron_flags(workdir: Path) -> list[str]:
    """A Megatron trainer command on a one-layer tiny Qwen3 (made here) that saves weights only."""
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.ckpt.torch_dist import convert_to_torch_dist

    hf = make_tiny_checkpoint("qwen3", 1, workdir / "hf", progress=False)
    dist = workdir / "torch_dist"
    if not dist.exists():
        dist.mkdir()
        convert_to_torch_dist(hf, dist, "qwen3", verify=False)
    return [
        "--hf-checkpoint", str(hf), "--ref-load", str(dist), "--train-backend", "megatron", "--num-threads", "1",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--no-save-optim",
    ]  # fmt: skip


def main() -> None:
    trials, workdir = int(sys.argv[1]), Path(sys.argv[2])
    argv = tiny_megatron_flags(workdir)
    # imported once, before the trainers fork (megatron-core through the adapter's CPU setup,
    # as the backend does on a machine without a GPU)
    import miles.train.backends.megatron
    import miles.train.checkpoint  # noqa: F401
    from miles.megatron import compat

    compat.install()
    import megatron.core.dist_checkpointing
    import megatron.core.models.gpt
    import megatron.core.optimizer  # noqa: F401
    import transformers  # noqa: F401

    mid_save, survivors = 0, []
    for batch in range(0, trials, AT_ONCE):
        trainers = {}
        for i in range(batch, min(trials, batch + AT_ONCE)):
            root = workdir / f"trial{i}"
            trainers[start(argv, root)] = root
        killed, left = kill_mid_save(trainers)
        mid_save += killed
        survivors += left
    print(json.dumps({"trials": trials, "killed_mid_save": mid_save, "survivors": survivors}), flush=True)


if __name__ == "__main__":  # multiprocessing's spawn imports this file again in its children
    main()
