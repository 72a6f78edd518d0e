"""Which engines a run starts: --rollout-num-gpus engines of --rollout-num-gpus-per-engine
devices, or the models and server groups of --sglang-config (miles.train.remote.groups)."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.train.config import EnginesConfig, JobConfig, SGLangConfig
from miles.train.rollout import RolloutEngineError

DEFAULT_MODEL = "default"


@dataclass(frozen=True)
class EngineSpec:
    name: str
    model: str  # its model's name (--sglang-config), "default" without one
    model_path: str
    updatable: bool  # it gets the trainer's weights
    rollout: bool  # rollout requests go to it
    devices: int  # its GPUs (its ranks in the weight-update group); 1 on the CPU
    first_device: int  # its first device among the rollout's own
    overrides: dict = field(default_factory=dict)  # SGLang server arguments of its group


def plan_engines(
    engines: EnginesConfig, job: JobConfig, sglang: SGLangConfig, hf_checkpoint: str
) -> list[EngineSpec]:
    """The engines of the run, devices counted from the first rollout device; --rollout-num-gpus
    must be what they take."""
    per_engine = sglang.rollout_num_gpus_per_engine
    if not engines.sglang_config:
        if not job.rollout_num_gpus or job.rollout_num_gpus % per_engine:
            raise RolloutEngineError(
                f"--rollout-num-gpus {job.rollout_num_gpus} must be a multiple of --rollout-num-gpus-per-engine "
                f"{per_engine}"
            )
        return [
            EngineSpec(f"engine-{i}", DEFAULT_MODEL, hf_checkpoint, True, True, per_engine, i * per_engine)
            for i in range(job.rollout_num_gpus // per_engine)
        ]
    from miles.train.remote.groups import load, rollout_model

    models = load(engines.sglang_config, hf_checkpoint=hf_checkpoint, gpus_per_engine=per_engine)
    total = sum(m.num_gpus for m in models)
    if job.rollout_num_gpus != total:
        raise RolloutEngineError(
            f"--sglang-config {engines.sglang_config} places engines on {total} device(s), but --rollout-num-gpus is "
            f"{job.rollout_num_gpus}; give --rollout-num-gpus {total}"
        )
    serving, specs, device = rollout_model(models), [], 0
    for model in models:
        index = 0
        for group in model.groups:
            for _ in range(group.engines):
                specs.append(
                    EngineSpec(
                        f"{model.name}-{index}", model.name, model.model_path, model.update_weights,
                        model.name == serving, group.num_gpus_per_engine, device, dict(group.overrides),
                    )
                )  # fmt: skip
                device += group.num_gpus_per_engine
                index += 1
            if group.worker_type == "placeholder":
                device += group.num_gpus
    return specs
