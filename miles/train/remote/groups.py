"""Engine groups from a file (--sglang-config), the seed framework's format (radixark/miles
31f1ca961, miles/backends/sglang_utils/sglang_config.py):

    sglang:
      - name: actor              # one entry per model
        model_path: /path        # default --hf-checkpoint
        update_weights: true     # it gets the trainer's weights (default: model_path is --hf-checkpoint)
        num_gpus_per_engine: 1   # default --rollout-num-gpus-per-engine
        server_groups:           # (engine_groups: an alias)
          - worker_type: regular # regular | placeholder (devices reserved, no engine)
            num_gpus: 4
            num_gpus_per_engine: 1
            overrides: {}        # SGLang server arguments of this group's engines

Every model's engines are started; rollouts go to the first model that gets the trainer's
weights, frozen models (reference, reward) keep their checkpoint. Prefill/decode groups (SGLang's
PD disaggregation) are refused: miles routes requests to whole engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from miles.train.rollout import RolloutEngineError

WORKER_TYPES = ("regular", "placeholder")


@dataclass(frozen=True)
class ServerGroup:
    worker_type: str
    num_gpus: int
    num_gpus_per_engine: int
    overrides: dict = field(default_factory=dict)

    @property
    def engines(self) -> int:
        return 0 if self.worker_type == "placeholder" else self.num_gpus // self.num_gpus_per_engine


@dataclass(frozen=True)
class ModelGroups:
    name: str
    model_path: str
    update_weights: bool
    groups: tuple[ServerGroup, ...]

    @property
    def num_gpus(self) -> int:
        return sum(g.num_gpus for g in self.groups)


def load(path: str, *, hf_checkpoint: str, gpus_per_engine: int) -> tuple[ModelGroups, ...]:
    """The models of an --sglang-config file, with their defaults resolved; a malformed file is
    one RolloutEngineError naming the file, the entry and the rule."""
    import yaml

    where = f"--sglang-config {path}"
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise RolloutEngineError(f"{where}: cannot read it ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("sglang"), list) or not data["sglang"]:
        raise RolloutEngineError(f"{where}: needs a top-level 'sglang' list of models (name, server_groups)")
    models = []
    for i, entry in enumerate(data["sglang"]):
        name = entry.get("name") if isinstance(entry, dict) else None
        if not name:
            raise RolloutEngineError(f"{where}: model {i} has no name")
        model_path = str(entry.get("model_path") or hf_checkpoint)
        default_gpus = int(entry.get("num_gpus_per_engine") or gpus_per_engine)
        groups = []
        for j, raw in enumerate(entry.get("server_groups") or entry.get("engine_groups") or []):
            kind = raw.get("worker_type", "regular")
            if kind not in WORKER_TYPES:
                raise RolloutEngineError(
                    f"{where}: model {name}, group {j}: worker_type {kind!r}; miles runs "
                    f"{', '.join(WORKER_TYPES)} groups (prefill/decode disaggregation is not built)"
                )
            gpus, per = int(raw.get("num_gpus", 0)), int(raw.get("num_gpus_per_engine") or default_gpus)
            if gpus < 1 or gpus % per:
                raise RolloutEngineError(
                    f"{where}: model {name}, group {j}: num_gpus {gpus} must be a positive multiple of "
                    f"num_gpus_per_engine {per}"
                )
            groups.append(ServerGroup(kind, gpus, per, dict(raw.get("overrides") or {})))
        if not groups:
            raise RolloutEngineError(f"{where}: model {name} has no server_groups")
        update = entry.get("update_weights")
        models.append(
            ModelGroups(
                name,
                model_path,
                model_path == hf_checkpoint if update is None else bool(update),
                tuple(groups),
            )
        )
    if len({m.name for m in models}) != len(models):
        raise RolloutEngineError(f"{where}: model names must be unique")
    if not any(m.update_weights for m in models):
        raise RolloutEngineError(
            f"{where}: no model gets the trainer's weights (update_weights), so none can roll out"
        )
    return tuple(models)


def rollout_model(models: tuple[ModelGroups, ...]) -> str:
    """The model rollouts go to: the first one that gets the trainer's weights."""
    return next(m.name for m in models if m.update_weights)
