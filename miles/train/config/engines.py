"""Rollout engines in processes of their own (--rollout-num-gpus without --colocate): how the
trainer's weights reach them (miles.train.remote) and fully asynchronous rollouts
(miles.train.async_rollout). Flag names and defaults follow the seeds' framework."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from miles.train.config.flags import (
    SGLANG_SERVERS,
    TORCH_SERVERS,
    TRAINER,
    Section,
    _non_negative_float,
    _positive_int,
    flag,
)

WEIGHT_TRANSFER_MODES = ("broadcast", "disk", "disk-delta")
WEIGHT_CHECKSUMS = ("sha256", "adler32", "xxh3-128", "blake3")


@dataclass(frozen=True)
class EnginesConfig(Section):
    name: ClassVar[str] = "engines"
    title: ClassVar[str] = "rollout engines in processes of their own"
    used_by: ClassVar[tuple[str, ...]] = (TORCH_SERVERS, SGLANG_SERVERS)

    update_weight_transfer_mode: str = flag(
        default="broadcast",
        choices=WEIGHT_TRANSFER_MODES,
        help="broadcast over a collective group with the engines, or through --update-weight-disk-dir: disk "
        "(every tensor) or disk-delta (changed bytes only)",
    )
    update_weight_disk_dir: str | None = flag(help="where disk and disk-delta syncs publish each version")
    update_weight_local_checkpoint_dir: str | None = flag(
        help="(disk-delta) the rollout host's own copy of the weights the deltas patch and the engines reload"
    )
    update_weight_delta_encoding: str = flag(default="xor", choices=("xor", "overwrite"))
    update_weight_delta_checksum: str = flag(default="sha256", choices=WEIGHT_CHECKSUMS)
    pause_generation_mode: str = flag(
        default="retract",
        choices=("abort", "retract", "in_place"),
        help="what a weight update does to requests in flight: abort them, retract them (recomputed with the "
        "new weights), or freeze them in place (their cache kept)",
    )
    sglang_config: str | None = flag(
        help="YAML of engine groups: models (update_weights or frozen), their server groups (miles.train.remote.groups)"
    )
    use_fault_tolerance: bool = flag(
        action="store_true",
        help="health-check the engines; a dead one is restarted and its requests go to the others",
    )
    rollout_health_check_interval: float = flag(
        type=_non_negative_float, default=30.0, help="seconds between checks"
    )
    rollout_health_check_timeout: float = flag(
        type=_non_negative_float, default=30.0, help="seconds an engine may take to answer /health_generate"
    )
    rollout_health_check_first_wait: float = flag(
        type=_non_negative_float, default=0.0, help="seconds before the first check"
    )
    # the persistent rollout worker is the trainer's (miles.train.async_rollout); its rules
    # (engines of their own, no abort pause) are the parser's
    fully_async: bool = flag(
        by=TRAINER, action="store_true", help="a persistent rollout worker generates while the trainer trains"
    )
    max_weight_staleness: int | None = flag(
        by=TRAINER, type=int, help="(fully async) most weight versions a trained group may lag the engines by"
    )
    async_data_buffer_capacity_factor: float = flag(
        by=TRAINER,
        type=_non_negative_float,
        default=2.0,
        help="(fully async) finished groups held, as a multiple of the rollout batch",
    )
    async_unused_samples_handler: str = flag(
        by=TRAINER,
        default="drop",
        choices=("retry", "drop"),
        help="(fully async) aborted or stale groups: regenerate or drop",
    )
    async_max_concurrent_samples: int | None = flag(
        by=TRAINER,
        type=_positive_int,
        help="(fully async) samples generating at once (default: one rollout batch)",
    )
