"""Fully asynchronous rollouts (--fully-async): a persistent worker generates while the trainer trains.

Trainer rank 0 runs a worker thread that keeps generating: it takes the next prompts (the
same order a synchronous run draws, `miles.train.data.batch_for_rollout`, recycled prompts
first), samples --n-samples-per-prompt responses of each from the engines in their own
processes, scores them and puts each finished group into a buffer of
--async-data-buffer-capacity-factor x --rollout-batch-size groups; when the buffer is full it
waits. Each training step drains --rollout-batch-size groups from it (in the order they were
drawn), so step k+1's samples are generated while step k trains, and wall time per step moves
from rollout + train towards the longer of the two. The seed framework's design, facts from
radixark/miles 31f1ca961 (miles/rollout/fully_async_rollout.py, fully_async_data_buffer.py).

A group's staleness is the engines' weight version when it is trained minus the oldest
version that produced any of its tokens (a weight sync pauses the requests in flight:
--pause-generation-mode retract or in_place; they finish with the new weights, and the
outputs say which version made which tokens). A group staler than --max-weight-staleness is
not trained; neither is one with an aborted sample. --async-unused-samples-handler `retry`
gives its prompt back to be generated again, `drop` discards it. What corrects for the
remaining staleness is the loss's truncated importance ratio against the behaviour policy's
logprobs (--use-tis: min(pi_old / pi_behaviour, --tis-clip), the engine's logprobs being the
behaviour policy's), as the seed's.

Evaluation shares the engines: the worker submits nothing while it runs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from miles.train import data
from miles.train.batch import Sample
from miles.train.distributed import sampling_seed
from miles.train.rollout import RolloutEngineError

NO_PROGRESS_WARN_S = 30.0  # a drain that waits this long says so


@dataclass
class Group:
    """One prompt's finished samples, with the weight versions that made them."""

    order: int  # its place in the prompt stream: batches are trained in this order
    prompt: data.Prompt
    samples: list[Sample]
    oldest_version: int
    aborted: bool


@dataclass
class DataBuffer:
    """Finished groups between the worker and the trainer (thread-safe).

    Rejected on `put`: groups with an aborted sample. Rejected on `get`: groups staler than
    `max_staleness` when taken. Both go to `unused`. Counters are read and reset by `metrics`.
    """

    capacity: int
    max_staleness: int | None
    unused: callable
    _groups: deque = field(default_factory=deque)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _aborted: int = 0
    _stale: int = 0
    _consumed: list[int] = field(default_factory=list)  # staleness of every group taken
    _trained: list[int] = field(default_factory=list)  # ... of those handed to training

    def room(self, wanted: int, stop: threading.Event) -> int:
        """Wait for space; how many groups (up to `wanted`) fit now (0 once `stop` is set)."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._groups) < self.capacity or stop.is_set())
            return 0 if stop.is_set() else min(wanted, self.capacity - len(self._groups))

    def put(self, group: Group) -> None:
        if group.aborted:
            with self._cond:
                self._aborted += 1
            self.unused(group)
            return
        with self._cond:
            self._groups.append(group)
            self._cond.notify_all()

    def get(self, current_version: int, timeout: float) -> Group | None:
        """The oldest group fresh enough to train at `current_version` (None after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                if not self._cond.wait_for(
                    lambda: self._groups, timeout=max(0.0, deadline - time.monotonic())
                ):
                    return None
                group = self._groups.popleft()
                self._cond.notify_all()  # a producer waiting for room
                staleness = current_version - group.oldest_version
                self._consumed.append(staleness)
                if self.max_staleness is None or staleness <= self.max_staleness:
                    self._trained.append(staleness)
                    return group
                self._stale += 1
            self.unused(group)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def metrics(self) -> dict[str, float]:
        prefix = "rollout/fully_async/"
        with self._cond:
            consumed, self._consumed = self._consumed, []
            trained, self._trained = self._trained, []
            metrics = {
                f"{prefix}queue_size": float(len(self._groups)),
                f"{prefix}aborted_groups_filtered": float(self._aborted),
                f"{prefix}stale_groups_filtered": float(self._stale),
            }
            self._aborted = self._stale = 0
        if consumed:  # the seed framework's: every group taken, the stale ones it filtered included
            metrics[f"{prefix}avg_staleness"] = sum(consumed) / len(consumed)
            metrics[f"{prefix}max_staleness"] = float(max(consumed))
        if trained:  # what the step trains on: within --max-weight-staleness
            metrics[f"{prefix}trained_avg_staleness"] = sum(trained) / len(trained)
            metrics[f"{prefix}trained_max_staleness"] = float(max(trained))
        return metrics


class PromptStream:
    """The prompts in the order a synchronous run draws them, prompts given back first."""

    def __init__(self, prompts, batch_size: int, *, seed: int, shuffle: bool):
        self.prompts, self.batch_size, self.seed, self.shuffle = prompts, batch_size, seed, shuffle
        self.position = 0
        self.recycled: deque = deque()
        self.lock = threading.Lock()

    def next(self) -> tuple[int, data.Prompt]:
        with self.lock:
            if self.recycled:
                return self.recycled.popleft()
            rollout, offset = divmod(self.position, self.batch_size)
            prompt = data.batch_for_rollout(
                self.prompts, rollout, self.batch_size, seed=self.seed, shuffle=self.shuffle
            )[offset]
            self.position += 1
            return self.position - 1, prompt

    def give_back(self, order: int, prompt: data.Prompt) -> None:
        with self.lock:
            self.recycled.append((order, prompt))


class AsyncRollouts:
    """The worker and its buffer (see the module docstring); `batch` is the trainer's step 1-2."""

    def __init__(self, run):
        cfg = run.config
        engines, rollout = cfg.engines, cfg.rollout
        self.run = run
        self.group_size = rollout.n_samples_per_prompt
        self.batch_size = rollout.rollout_batch_size
        concurrent = engines.async_max_concurrent_samples
        self.wave = max(1, concurrent // self.group_size) if concurrent else self.batch_size
        capacity = max(1, int(engines.async_data_buffer_capacity_factor * self.batch_size))
        self.retry = engines.async_unused_samples_handler == "retry"
        self.buffer = DataBuffer(capacity, engines.max_weight_staleness, self._unused)
        self.stream = PromptStream(
            run.prompts, self.batch_size, seed=cfg.job.seed, shuffle=cfg.data.rollout_shuffle
        )
        self.world = run.engine.world  # the engines in their own processes: rank 0 talks to them
        self.fresh = True  # the last batch was made by the weights being trained alone
        self.submitting = threading.Event()  # cleared while evaluation has the engines
        self.submitting.set()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.recycled = 0
        self.thread: threading.Thread | None = None

    # --- the worker (rank 0) ---

    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="miles-rollout-worker", daemon=True)
            self.thread.start()

    def _work(self) -> None:
        try:
            wave = 0
            while not self.stop.is_set():
                self.submitting.wait()
                count = self.buffer.room(self.wave, self.stop)
                if count == 0:
                    continue
                self._generate([self.stream.next() for _ in range(count)], wave)
                wave += 1
        except BaseException as exc:
            self.error = exc
            self.buffer.wake()

    def _generate(self, drawn: list[tuple[int, data.Prompt]], wave: int) -> None:
        run, n = self.run, self.group_size
        requests = [run.encode(p) for _, p in drawn for _ in range(n)]
        seed = sampling_seed(run.config.rollout.rollout_seed, wave, 0)
        outputs = run.engine.outputs(requests, run.sampling, seed)
        for g, (order, prompt) in enumerate(drawn):
            mine = outputs[g * n : (g + 1) * n]
            samples = []
            for i, out in enumerate(mine):
                text, reward = run.score(prompt, out.generation, i) if not out.aborted else ("", 0.0)
                samples.append(Sample(prompt.index, g, out.generation, text, prompt.label, reward))
            oldest = min(min(out.versions) for out in mine)
            self.buffer.put(Group(order, prompt, samples, oldest, any(o.aborted for o in mine)))

    def _unused(self, group: Group) -> None:
        if self.retry:
            self.recycled += 1
            self.stream.give_back(group.order, group.prompt)

    # --- the trainer's side ---

    def batch(self, rollout_id: int) -> list[Sample]:
        """--rollout-batch-size groups from the buffer (rank 0 drains; every rank gets them)."""
        samples, self.fresh = self.world.exchange(None, lambda _: self._drain(rollout_id))
        return samples

    def _drain(self, rollout_id: int) -> tuple[list[Sample], bool]:
        self._start()
        groups: list[Group] = []
        version = self.run.engine.version
        while len(groups) < self.batch_size:
            if self.error is not None:
                raise RolloutEngineError(
                    f"the fully-async rollout worker stopped: {self.error}"
                ) from self.error
            group = self.buffer.get(version, NO_PROGRESS_WARN_S)
            if group is None:
                self.run.log(
                    f"miles.train: rollout {rollout_id}: no finished group for {NO_PROGRESS_WARN_S:.0f}s"
                )
                continue
            groups.append(group)
        groups.sort(key=lambda g: g.order)
        fresh = all(g.oldest_version == version for g in groups)
        return [replace(s, group=i) for i, g in enumerate(groups) for s in g.samples], fresh

    def metrics(self) -> dict[str, float]:
        """The buffer's counters since the last step (rank 0's, on every rank)."""
        recycled = self.recycled
        self.recycled = 0
        return self.world.exchange(
            None, lambda _: self.buffer.metrics() | {"rollout/fully_async/recycled_groups": float(recycled)}
        )

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The worker submits nothing inside (evaluation shares the engines)."""
        self.submitting.clear()
        try:
            yield
        finally:
            self.submitting.set()

    def close(self) -> None:
        self.stop.set()
        self.submitting.set()
        self.buffer.wake()
