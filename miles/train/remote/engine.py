"""The trainer's rollout engine when engines run in processes of their own (disaggregated).

`--rollout-num-gpus N` without `--colocate` places the rollout on devices of its own: on GPUs,
SGLang servers on the N GPUs after the training ones, one per --rollout-num-gpus-per-engine;
on the CPU, N built-in engine servers, one process each (separate processes, and separate
process groups: each joins trainer rank 0 only in the weight-update group). Trainer rank 0
starts them and talks to them; the other ranks hand it their prompts and get their answers
back, and drain the weight stream a sync produces (it may take collectives) while rank 0 sends
it (miles.train.remote.transfer). An error on rank 0 is raised on every rank.

The engines' weights are checked by checksum after a sync (`/weights_checker`, the same
digest as SGLang's; the built-in server's tensors keep the trainer's names), bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from miles.train.config import (
    CheckpointConfig,
    ChecksConfig,
    EnginesConfig,
    JobConfig,
    OptimizerConfig,
    SamplingConfig,
    SGLangConfig,
)
from miles.train.remote.client import EngineClient, Output
from miles.train.remote.fleet import (
    Engine,
    FaultTolerance,
    Fleet,
    log_dir,
    spawn,
    torch_server_args,
    wait_for_file,
)
from miles.train.remote.plan import plan_engines
from miles.train.rollout import Generation, RolloutEngine, RolloutEngineError


class RemoteRolloutEngine(RolloutEngine):
    """Built-in engine servers, one process per engine (the CPU's placement)."""

    name = "torch"
    exact_weights = False  # its tensors live in other processes: checked by checksum
    checksummed = True
    weight_names = "model"  # the server holds the transformers model's own names

    @property
    def holds_mtp_layers(self) -> bool:
        return False  # its servers do not speculate, so they hold no MTP layers

    def __init__(
        self,
        *,
        engines: EnginesConfig,
        job: JobConfig,
        sglang: SGLangConfig,
        checkpoint: CheckpointConfig,
        optimizer: OptimizerConfig,
        checks: ChecksConfig,
        dist_info,
    ):
        self.dtype = "bfloat16" if optimizer.bf16 else "float32"
        specs = plan_engines(engines, job, sglang, checkpoint.hf_checkpoint)
        if any(s.devices != 1 for s in specs):
            raise RolloutEngineError(
                "on the CPU each built-in engine is one process on one device: use --rollout-num-gpus-per-engine 1 "
                "(and num_gpus_per_engine 1 in --sglang-config); the engine count is the rollout's devices"
            )
        if any(s.overrides for s in specs):
            raise RolloutEngineError(
                f"--sglang-config {engines.sglang_config}: a server group's overrides are SGLang server arguments, "
                "which the built-in engine does not take"
            )
        self._connect(engines, sglang, dist_info, specs, backend="gloo", crash=checks.ci_test)

    def _connect(
        self, engines: EnginesConfig, sglang: SGLangConfig, dist_info, specs, *, backend: str, crash: bool
    ) -> None:
        """Rank 0 starts the engines and the transfer; every rank waits until they serve. With
        --use-fault-tolerance the fleet watches them, and with --ci-test too it kills one engine
        while the second batch of requests is in flight (the seed framework's simulated crash)."""
        from miles.train.sglang_weights import EngineGroup

        self.rank, self.world_size = dist_info.rank, dist_info.world_size
        self.pause_mode = engines.pause_generation_mode
        self.version = -1  # the engines start from --hf-checkpoint; the first sync is version 0
        self.world = EngineGroup(tuple(range(self.world_size)), self.rank, _world_group(self.world_size))
        self.fleet: Fleet | None = None
        self.transfer = None
        tolerance = None
        if engines.use_fault_tolerance:
            tolerance = FaultTolerance(
                engines.rollout_health_check_interval,
                engines.rollout_health_check_timeout,
                engines.rollout_health_check_first_wait,
            )

        def start(_):
            self.fleet = Fleet(self._start_engines(specs), fault_tolerance=tolerance, log=_log)
            self.fleet.crash_at = 2 if crash and tolerance is not None else None
            self.fleet.watch()
            self.transfer = make_transfer(engines, sglang, backend=backend, address="127.0.0.1")

        self.world.exchange(None, start)  # an engine that does not start stops every rank

    def _start_engines(self, specs) -> list[Engine]:
        """The built-in engine servers, started together, each waited for."""
        logs = log_dir()
        started = []
        for spec in specs:
            log, ready = logs / f"{spec.name}.log", logs / f"{spec.name}.url"
            ready.unlink(missing_ok=True)
            args = torch_server_args(spec.name, spec.model_path, self.dtype, ready)
            started.append((spec, log, ready, args, spawn("miles.train.remote.server", args, log)))
        engines = []
        for spec, log, ready, args, process in started:
            url = wait_for_file(ready, process, spec.name, log)
            engines.append(
                Engine(spec.name, spec.model, spec.updatable, spec.rollout, EngineClient(url, spec.name),
                       process=process, log=log, start=_restarter(spec.name, log, ready, args),
                       model_path=spec.model_path)
            )  # fmt: skip
        return engines

    @property
    def weight_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    # --- generation: rank 0 sends every rank's prompts ---

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        def serve(asked: list) -> list:
            flat = [p for part in asked for p in part]
            outputs = self.fleet.generate(flat, sampling, seed)
            unfinished = [o for o in outputs if o.aborted]
            if unfinished:
                raise RolloutEngineError(
                    f"{len(unfinished)} of {len(outputs)} requests came back unfinished "
                    f"({unfinished[0].generation.finish_reason}) outside a weight update; see the engines' logs"
                )
            answers, start = [], 0
            for part in asked:
                answers.append([o.generation for o in outputs[start : start + len(part)]])
                start += len(part)
            return answers

        answers = self.world.exchange([list(p) for p in prompts], serve)
        return answers[self.rank]

    def outputs(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seed: int) -> list[Output]:
        """Rank 0 only: the engines' answers with their weight versions (the async worker's call)."""
        return self.fleet.generate(prompts, sampling, seed)

    # --- weights ---

    def update_weights(self, named_tensors: Iterable[tuple[str, object]]) -> None:
        """Rank 0 pauses the engines, sends the stream (miles.train.remote.transfer) and lets them
        continue; every other rank drains it. Every rank raises rank 0's error."""
        stream = iter(named_tensors)
        failure = None
        if self.rank == 0:
            try:
                self._push(stream)
            except RolloutEngineError as exc:
                failure = str(exc)
        for _ in stream:  # the rest (all of it, on the other ranks): its collectives must run
            pass
        outcome = self.world.exchange(None, lambda _: failure)
        if outcome:
            raise RolloutEngineError(outcome)

    def _push(self, stream: Iterator) -> None:
        engines = self.fleet.updatable()
        if not engines:
            raise RolloutEngineError("no rollout engine is alive to take the weights")
        self.version += 1
        self.fleet.call(engines, "/pause_generation", {"mode": self.pause_mode})
        try:
            self.transfer.push(self.fleet, engines, stream, self.version)
            if self.pause_mode != "in_place":  # prefixes cached with the old weights (SGLang's radix cache)
                self.fleet.call(engines, "/flush_cache")
        finally:
            self.fleet.call(engines, "/continue_generation")
        self.fleet.mark_current(engines)

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        """Each updatable engine's checksum of every tensor it holds (rank 0; empty elsewhere).
        A frozen model's engines (--sglang-config update_weights false) must still hold their
        checkpoint, tensor for tensor: one that does not is an error here."""
        if self.rank != 0:
            return {}
        engines = [e for e in self.fleet.engines if e.alive and e.kind == "torch"]
        answers = self.fleet.call(engines, "/weights_checker", {"action": "checksum"})
        sums = {e.name: a["ranks"][0]["checksums"] for e, a in zip(engines, answers, strict=True)}
        for engine in engines:
            if not engine.updatable:
                _check_frozen(engine, sums.pop(engine.name), self.weight_dtype)
        return sums

    def rollout_metrics(self) -> dict[str, float]:
        """Requests sent again since the last call, engines alive, restarts so far (rank 0)."""
        if self.rank != 0:
            return {}
        retries, self.fleet.retries = self.fleet.retries, 0
        alive = sum(e.alive for e in self.fleet.engines)
        restarts = sum(e.restarts for e in self.fleet.engines)
        return {"rollout/engine_retries": float(retries), "rollout/engines_alive": float(alive),
                "rollout/engine_restarts": float(restarts)}  # fmt: skip

    def named_weights(self) -> Iterator[tuple[str, object]]:
        raise NotImplementedError("the engines' tensors live in their own processes; see weight_checksums()")

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
        if self.fleet is not None:
            self.fleet.close()


def make_transfer(engines: EnginesConfig, sglang: SGLangConfig, *, backend: str, address: str):
    from miles.train.remote.checksums import missing_package
    from miles.train.remote.disk import Publisher
    from miles.train.remote.transfer import BroadcastTransfer, DiskTransfer

    bucket = sglang.update_weight_buffer_size or 512 << 20
    mode = engines.update_weight_transfer_mode
    if mode == "broadcast":
        return BroadcastTransfer(backend=backend, address=address, bucket_bytes=bucket)
    if not engines.update_weight_disk_dir:
        raise RolloutEngineError(f"--update-weight-transfer-mode {mode} needs --update-weight-disk-dir")
    delta = mode == "disk-delta"
    if delta and not engines.update_weight_local_checkpoint_dir:
        raise RolloutEngineError(
            "--update-weight-transfer-mode disk-delta needs --update-weight-local-checkpoint-dir (the engine host's "
            "own copy the deltas patch)"
        )
    package = missing_package(engines.update_weight_delta_checksum)
    if package:
        raise RolloutEngineError(
            f"--update-weight-delta-checksum {engines.update_weight_delta_checksum} needs the {package} package; "
            "install it or use sha256 or adler32"
        )
    publisher = Publisher(
        Path(engines.update_weight_disk_dir),
        delta=delta,
        encoding=engines.update_weight_delta_encoding,
        checksum=engines.update_weight_delta_checksum,
        bucket_bytes=bucket,
    )
    return DiskTransfer(publisher, engines.update_weight_local_checkpoint_dir)


def _check_frozen(engine: Engine, sums: dict[str, str], dtype) -> None:
    """A frozen engine's checksums against its checkpoint's files (the names the files hold), the
    files' tensors in the engine's dtype."""
    from miles.ckpt.shards import CheckpointReader
    from miles.train.remote.checksums import tensor_checksum

    reader = CheckpointReader(engine.model_path)
    try:
        names = [n for n in reader.files.weight_map if n in sums]
        differing = [n for n in names if tensor_checksum(reader.read(n).to(dtype)) != sums[n]]
    finally:
        reader.close()
    if not names or differing:
        raise RolloutEngineError(
            f"rollout engine {engine.name} of a frozen model no longer holds its checkpoint {engine.model_path}: "
            f"{len(differing)} of {len(names)} tensor(s) differ ({', '.join(differing[:3])})"
        )


def _log(message: str) -> None:
    print(message, flush=True)


def _restarter(name: str, log: Path, ready: Path, args: list[str]):
    def start():
        ready.unlink(missing_ok=True)
        process = spawn("miles.train.remote.server", args, log)
        return process, wait_for_file(ready, process, name, log)

    return start


def _world_group(world_size: int):
    if world_size == 1:
        return None
    import torch.distributed as dist

    return dist.group.WORLD


__all__ = ["FaultTolerance", "RemoteRolloutEngine", "make_transfer"]
