"""The checks and logging sections: the in-loop CI checks, debugging switches and loggers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from miles.train.config.flags import (
    TRAINER,
    Section,
    _non_negative_float,
    _positive_int,
    _switch,
    _text,
    flag,
)


@dataclass(frozen=True)
class ChecksConfig(Section):
    name: ClassVar[str] = "checks"
    title: ClassVar[str] = "checks and CI"
    used_by: ClassVar[tuple[str, ...]] = (TRAINER,)

    ci_test: bool = flag(action="store_true", help="assert the in-loop checks (see miles.train.checks)")
    ci_disable_kl_checker: bool = flag(action="store_true", help="skip the step-0 ppo_kl check")
    check_weight_update_equal: bool = flag(action="store_true", help="check weight sync every step")
    check_weight_update_skip_list: tuple[str, ...] = flag(
        nargs="*", default=[], help="name substrings to skip"
    )
    ci_logprob_abs_diff_tol: float = flag(type=_non_negative_float, default=1e-3)
    ci_step0_kl_tol: float = flag(type=_non_negative_float, default=1e-6)
    ci_metric_checker_key: str | None = _text()
    ci_metric_checker_threshold: float | None = flag(type=float)
    dry_start: bool = flag(
        action="store_true",
        help="check the flags and the starting checkpoint: build the model at the layout, load its weights, stop",
    )
    debug_rollout_only: bool = _switch()
    debug_train_only: bool = _switch(by=())
    save_debug_rollout_data: str | None = _text()
    load_debug_rollout_data: str | None = _text()


@dataclass(frozen=True)
class LoggingConfig(Section):
    name: ClassVar[str] = "logging"
    title: ClassVar[str] = "logging"
    # No component logs to wandb or tensorboard yet: each of these is refused when set.

    log_interval: int = flag(type=_positive_int, default=1)
    log_passrate: bool = _switch()
    use_wandb: bool = _switch()
    wandb_project: str | None = _text()
    wandb_group: str | None = _text()
    wandb_key: str | None = _text()
    wandb_host: str | None = _text()
    wandb_mode: str | None = _text()
    wandb_team: str | None = _text()
    disable_wandb_random_suffix: bool = _switch()
    use_tensorboard: bool = _switch()
