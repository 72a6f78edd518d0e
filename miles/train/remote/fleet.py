"""The rollout engines of a run: their processes, their health, and the requests routed to them.

An engine is a process serving SGLang's HTTP API: the built-in engine server on the CPU
(`python -m miles.train.remote.server`, one process per engine) or `python -m
sglang.launch_server` on GPUs (one per --rollout-num-gpus-per-engine GPUs, after the training
GPUs), or one already running (--rollout-external-engine-addrs). The fleet starts them, waits
until each serves, and splits a batch of requests over the engines that serve rollouts, in
order, so the same batch goes the same way every time.

With --use-fault-tolerance an engine that stops answering (its process died, or its
/health_generate did not answer within --rollout-health-check-timeout, probed every
--rollout-health-check-interval seconds after --rollout-health-check-first-wait) is taken out:
its process is killed, the requests it held are sent again to the others, and it is started
anew; it serves again once a weight sync has given it the trainer's weights. Results are kept
by request position, so a retried request replaces its lost answer: nothing is lost or counted
twice. Without fault tolerance, an unreachable engine stops the run with one line.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from miles.train.config import SamplingConfig
from miles.train.remote.client import EngineClient, EngineUnreachable, Output
from miles.train.rollout import RolloutEngineError

START_TIMEOUT = 900.0  # seconds for an engine process to load its model and serve


@dataclass
class Engine:
    name: str
    model: str  # its model's name in --sglang-config ("default" without one)
    updatable: bool  # it gets the trainer's weights (a frozen model's engines do not)
    rollout: bool  # rollout requests go to it
    client: EngineClient
    kind: str = "torch"  # its server: the built-in engine server, or sglang
    ranks: int = 1  # its ranks in the weight-update group (its GPUs)
    process: subprocess.Popen | None = None
    start: Callable[[], tuple[subprocess.Popen | None, str]] | None = None  # (re)starts it: (process, url)
    alive: bool = True
    current: bool = True  # holds the trainer's latest weights
    restarts: int = 0
    log: Path | None = None
    model_path: str = ""


@dataclass
class FaultTolerance:
    interval: float
    timeout: float
    first_wait: float


@dataclass
class Fleet:
    engines: list[Engine]
    fault_tolerance: FaultTolerance | None = None
    log: Callable[[str], None] = print
    retries: int = 0  # requests sent again after their engine died
    crash_at: int | None = None  # fault injection: kill an engine during this generate call (1-based)
    _calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _monitor: threading.Thread | None = None
    _closed: threading.Event = field(default_factory=threading.Event)
    _restarts: queue.Queue = field(default_factory=queue.Queue)

    # --- who serves ---

    def serving(self) -> list[Engine]:
        with self._lock:
            return [e for e in self.engines if e.alive and e.current and e.rollout]

    def updatable(self) -> list[Engine]:
        """Engines a weight sync goes to: the alive ones of updatable models."""
        with self._lock:
            return [e for e in self.engines if e.alive and e.updatable]

    # --- requests ---

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seed: int) -> list[Output]:
        """One output per prompt, in order: contiguous chunks over the serving engines (engine i
        samples its chunk with seed + i); a chunk whose engine dies goes to another."""
        engines = self.serving()
        if not engines:
            raise RolloutEngineError(self._none_serving())
        size = -(-len(prompts) // len(engines))
        chunks = [(i, list(prompts[i * size : (i + 1) * size])) for i in range(len(engines))]
        chunks = [(i, c) for i, c in chunks if c]
        results: dict[int, list[Output]] = {}
        self._calls += 1
        if self._calls == self.crash_at:
            # killed as this call's requests go out (not once they are seen running: on a busy
            # machine an engine can answer before a poll sees its requests, and none is lost)
            self._crash(engines[chunks[0][0]])
        with ThreadPoolExecutor(max_workers=len(chunks)) as pool:
            futures = {
                i: pool.submit(self._chunk, engines[i], chunk, sampling, seed + i) for i, chunk in chunks
            }
            for i, future in futures.items():
                results[i] = future.result()
        return [out for i, _ in chunks for out in results[i]]

    def _chunk(self, engine: Engine, prompts, sampling: SamplingConfig, seed: int) -> list[Output]:
        while True:
            try:
                return engine.client.generate(prompts, sampling, seed)
            except EngineUnreachable as exc:
                if self.fault_tolerance is None:
                    raise RolloutEngineError(
                        f"{exc}; its log: {engine.log or '-'} (with --use-fault-tolerance the run would retry its "
                        "requests on the other engines)"
                    ) from None
                self.lost(engine, str(exc))
                engine = self._another(engine)
                with self._lock:
                    self.retries += len(prompts)
                self.log(f"miles.train: {len(prompts)} request(s) of the lost engine go to {engine.name}")

    def _crash(self, engine: Engine) -> None:
        """Fault injection: SIGKILL `engine`'s process during a rollout, as an engine that dies
        mid-rollout: the requests sent to it fail and go to the others."""
        pid = engine.process.pid if engine.process else "-"
        self.log(
            f"miles.train: fault injection: killing rollout engine {engine.name} (pid {pid}) mid-rollout"
        )
        stop_process(engine.process)

    def _another(self, dead: Engine) -> Engine:
        engines = self.serving()
        if not engines:
            raise RolloutEngineError(self._none_serving())
        index = self.engines.index(dead)
        return min(engines, key=lambda e: (self.engines.index(e) - index) % len(self.engines))

    def _none_serving(self) -> str:
        dead = [e.name for e in self.engines if not e.alive]
        return (
            f"no rollout engine serves (dead: {', '.join(dead) or 'none'}); their logs: "
            f"{', '.join(str(e.log) for e in self.engines if e.log) or '-'}"
        )

    def call(
        self, engines: Sequence[Engine], route: str, body: dict | None = None, *, timeout: float | None = None
    ):
        """`route` on every engine at once; their answers in order (the first error is raised)."""
        if not engines:
            return []
        with ThreadPoolExecutor(max_workers=len(engines)) as pool:
            futures = [pool.submit(e.client.post, route, body, timeout=timeout) for e in engines]
            return [f.result() for f in futures]

    # --- health ---

    def watch(self) -> None:
        """Start the health monitor (with fault tolerance)."""
        if self.fault_tolerance is None or self._monitor is not None:
            return
        self._monitor = threading.Thread(target=self._watch, name="miles-engine-health", daemon=True)
        self._monitor.start()

    def _watch(self) -> None:
        """Health checks and restarts, in one long-lived thread: an engine process dies with the
        thread that started it (miles.children.die_with)."""
        ft = self.fault_tolerance
        due = time.monotonic() + ft.first_wait
        while not self._closed.is_set():
            try:
                engine = self._restarts.get(timeout=max(0.0, min(due - time.monotonic(), ft.interval)))
            except queue.Empty:
                engine = None
            if engine is not None:
                self._restart(engine)
            elif time.monotonic() >= due:
                self._check_health(ft.timeout)
                due = time.monotonic() + ft.interval

    def _check_health(self, timeout: float) -> None:
        for engine in list(self.engines):
            if not engine.alive or self._closed.is_set():
                continue
            try:
                engine.client.get("/health_generate", timeout=timeout)
            except RolloutEngineError as exc:
                self.lost(engine, f"health check: {exc}")

    def lost(self, engine: Engine, why: str) -> None:
        """Take a dead or unresponsive engine out, kill its process and have it started again."""
        with self._lock:
            if not engine.alive:
                return
            engine.alive = engine.current = False
        self.log(f"miles.train: rollout engine {engine.name} lost ({why}); restarting it")
        stop_process(engine.process)
        if engine.start is not None and self._monitor is not None:
            self._restarts.put(engine)

    def _restart(self, engine: Engine) -> None:
        try:
            process, url = engine.start()
        except RolloutEngineError as exc:
            self.log(f"miles.train: rollout engine {engine.name} did not restart: {exc}")
            return
        with self._lock:
            engine.process, engine.client = process, EngineClient(url, engine.name, engine.client.timeout)
            engine.restarts += 1
            engine.alive = True
            engine.current = not engine.updatable  # serves once a sync gave it the trainer's weights
        self.log(
            f"miles.train: rollout engine {engine.name} restarted at {url}; it serves after the next weight sync"
        )

    def mark_current(self, engines: Sequence[Engine]) -> None:
        with self._lock:
            for engine in engines:
                engine.current = True

    def close(self) -> None:
        self._closed.set()
        for engine in self.engines:
            stop_process(engine.process)


def stop_process(process: subprocess.Popen | None) -> None:
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()
    process.wait()


# --- starting engine processes ----------------------------------------------------------------


def log_dir() -> Path:
    """Where engine processes write their logs: $MILES_ENGINE_LOG_DIR, else a fresh temporary one."""
    given = os.environ.get("MILES_ENGINE_LOG_DIR")
    path = Path(given) if given else Path(tempfile.mkdtemp(prefix="miles-engines-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def spawn(module: str, args: Sequence[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """`python -m module args` as an engine process: a session of its own (killed as a group),
    output to `log`, and killed when the thread that started it ends (miles.train.remote.launch)."""
    argv = [sys.executable, "-m", "miles.train.remote.launch", str(os.getpid()), module, *args]
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**engine_env(), **(env or {})},
            start_new_session=True,
        )


# What torchrun sets for the trainer's ranks: an engine is no rank of the trainer's world, and
# torch's tcp:// rendezvous (SGLang's weight-update group) would follow TORCHELASTIC_* to the
# launcher's store.
TRAINER_WORLD_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


def engine_env() -> dict[str, str]:
    """This process's environment without the trainer world's variables."""
    return {
        k: v
        for k, v in os.environ.items()
        if k not in TRAINER_WORLD_ENV and not k.startswith("TORCHELASTIC_")
    }


def torch_server_args(name: str, hf_checkpoint: str, dtype: str, ready: Path) -> list[str]:
    return ["--hf-checkpoint", hf_checkpoint, "--dtype", dtype, "--name", name, "--ready-file", str(ready)]


def wait_for_file(
    ready: Path, process: subprocess.Popen, name: str, log: Path, timeout: float = START_TIMEOUT
) -> str:
    """The URL the engine wrote once it serves; its exit or the timeout is an error naming its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready.is_file():
            return ready.read_text().strip()
        if process.poll() is not None:
            raise RolloutEngineError(
                f"rollout engine {name} exited with code {process.returncode} while starting: {_tail(log)} "
                f"(its log: {log})"
            )
        time.sleep(0.1)
    stop_process(process)
    raise RolloutEngineError(f"rollout engine {name} did not serve within {timeout:.0f}s (its log: {log})")


def wait_for_health(
    client: EngineClient, process: subprocess.Popen, log: Path, timeout: float = START_TIMEOUT
) -> None:
    """Poll /health_generate until it answers (a server that prints no ready file: SGLang's)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RolloutEngineError(
                f"rollout engine {client.name} exited with code {process.returncode} while starting: {_tail(log)} "
                f"(its log: {log})"
            )
        try:
            client.get("/health_generate", timeout=10)
            return
        except RolloutEngineError:
            time.sleep(1.0)
    stop_process(process)
    raise RolloutEngineError(
        f"rollout engine {client.name} did not serve within {timeout:.0f}s (its log: {log})"
    )


def _tail(log: Path, lines: int = 1) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "-"
    return " | ".join(text[-lines:]) if text else "(no output)"
