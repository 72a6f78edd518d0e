"""SGLang servers as the rollout engines on GPUs of their own (disaggregated placement).

Trainer rank 0 starts `python -m sglang.launch_server` once per --rollout-num-gpus-per-engine
GPUs of the --rollout-num-gpus after the training GPUs on its node (`--base-gpu-id`; one node:
several nodes place their engines with Ray), with `--tp-size`, `--random-seed` (--rollout-seed
plus the engine's index), `--mem-fraction-static` and every `--sglang-<name> VALUE` as
`--<name> VALUE`, names checked against the pinned sglang's ServerArgs. It waits for each
server's /health_generate. Weights reach them by the transfer mode (miles.train.remote.transfer:
broadcast over NCCL, or the disk modes), under the checkpoint files' names, in the dtype SGLang
serves; an FP8 checkpoint's engines get FP8 weights (miles.train.fp8_export). SGLang's own
`/weights_checker` checksums its fused tensors, so the weight check compares the logprobs of
fixed prompts (miles.train.checks). Written against sglang 0.5.23; it has not run on a GPU here.
"""

from __future__ import annotations

from collections.abc import Iterable

from miles.train.config import (
    CheckpointConfig,
    ChecksConfig,
    EnginesConfig,
    JobConfig,
    RolloutConfig,
    SGLangConfig,
)
from miles.train.remote.client import EngineClient
from miles.train.remote.engine import RemoteRolloutEngine
from miles.train.remote.fleet import Engine, log_dir, spawn, wait_for_health
from miles.train.remote.group import free_port
from miles.train.remote.plan import plan_engines
from miles.train.rollout import RolloutEngineError


class RemoteSGLangEngine(RemoteRolloutEngine):
    name = "sglang"
    checksummed = False
    weight_names = "checkpoint"  # SGLang's models load checkpoint names

    def __init__(
        self,
        *,
        engines: EnginesConfig,
        job: JobConfig,
        sglang: SGLangConfig,
        checkpoint: CheckpointConfig,
        rollout: RolloutConfig,
        checks: ChecksConfig,
        dist_info,
    ):
        from miles.train.fp8_export import Fp8ExportError, fp8_export_for
        from miles.train.sglang_engine import served_dtype

        if dist_info.device == "cpu":
            raise RolloutEngineError(
                "--rollout-engine sglang needs GPUs; on the CPU use --rollout-engine torch"
            )
        if job.actor_num_nodes != 1:
            raise RolloutEngineError(
                f"--actor-num-nodes {job.actor_num_nodes}: SGLang servers are placed on the trainer's node here; "
                "a run of several nodes places them with Ray (python -m miles.recipes's Ray launch)"
            )
        specs = plan_engines(engines, job, sglang, checkpoint.hf_checkpoint)
        self.seed, self.first_gpu = rollout.rollout_seed, job.actor_num_gpus_per_node
        self.server_args = server_cli_args(sglang)
        self.seeded = "--enable-deterministic-inference" in self.server_args
        try:
            self.fp8 = fp8_export_for(checkpoint.hf_checkpoint)
        except Fp8ExportError as exc:
            raise RolloutEngineError(f"--hf-checkpoint: {exc}") from None
        dtype = sglang.server_args.get("dtype", "auto")
        self._weight_dtype = (
            None if self.fp8 is not None else served_dtype(checkpoint.hf_checkpoint, {"dtype": dtype})
        )
        self._connect(engines, sglang, dist_info, specs, backend="nccl", crash=checks.ci_test)

    @property
    def weight_dtype(self):
        return self._weight_dtype

    def _start_engines(self, specs) -> list[Engine]:
        logs = log_dir()
        started = []
        for i, spec in enumerate(specs):
            port = free_port()
            overrides = [a for k, v in spec.overrides.items() for a in (f"--{k.replace('_', '-')}", str(v))]
            args = [
                "--model-path", spec.model_path, "--host", "127.0.0.1", "--port", str(port),
                "--tp-size", str(spec.devices), "--base-gpu-id", str(self.first_gpu + spec.first_device),
                "--random-seed", str(self.seed + i), *self.server_args, *overrides,
            ]  # fmt: skip
            log = logs / f"{spec.name}.log"
            process = spawn("sglang.launch_server", args, log)
            started.append((spec, log, process, EngineClient(f"http://127.0.0.1:{port}", spec.name), args))
        engines = []
        for spec, log, process, client, args in started:
            wait_for_health(client, process, log)
            engines.append(
                Engine(spec.name, spec.model, spec.updatable, spec.rollout, client, kind="sglang", ranks=spec.devices,
                       process=process, log=log, model_path=spec.model_path, start=_restarter(client, log, args))
            )  # fmt: skip
        return engines

    def update_weights(self, named_tensors: Iterable[tuple[str, object]]) -> None:
        super().update_weights(self.fp8(named_tensors) if self.fp8 is not None else named_tensors)


def _restarter(client: EngineClient, log, args: list[str]):
    def start():
        process = spawn("sglang.launch_server", args, log)
        wait_for_health(client, process, log)
        return process, client.url

    return start


def server_cli_args(sglang: SGLangConfig) -> list[str]:
    """launch_server's flags for the SGLang section: --mem-fraction-static and every
    --sglang-<name> VALUE as --<name> VALUE (a bare switch as the flag alone); a name the pinned
    sglang's ServerArgs lacks is refused."""
    from miles.train.sglang_server import server_fields

    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError as exc:
        raise RolloutEngineError(f"--rollout-engine sglang: sglang is not installed ({exc})") from None
    fields = server_fields(ServerArgs)
    args = ["--log-level", "error"]
    if sglang.sglang_mem_fraction_static is not None:
        args += ["--mem-fraction-static", str(sglang.sglang_mem_fraction_static)]
    for name, value in sglang.server_args.items():
        if name not in fields:
            raise RolloutEngineError(
                f"--sglang-{name.replace('_', '-')}: this SGLang has no server argument '{name}'"
            )
        flag = f"--{name.replace('_', '-')}"
        if value is True:
            args.append(flag)
        else:
            args += [flag, *(value if isinstance(value, list) else [value])]
    return args
