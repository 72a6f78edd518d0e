"""The checks and logging sections: the in-loop CI checks, debugging switches and loggers."""

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
    _switch,
    _text,
    flag,
)

_NO_ENGINE_DUMPS = (
    "no rollout engine dumps its tensors yet: --dumper-enable dumps the training model's forwards only"
)


@dataclass(frozen=True)
class ChecksConfig(Section):
    name: ClassVar[str] = "checks"
    title: ClassVar[str] = "checks and CI"
    used_by: ClassVar[tuple[str, ...]] = (TRAINER,)

    # engines in their own processes with --use-fault-tolerance: --ci-test kills one mid-rollout
    ci_test: bool = flag(
        by=(TRAINER, TORCH_SERVERS, SGLANG_SERVERS),
        action="store_true",
        help="assert the in-loop checks (see miles.train.checks)",
    )
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
    ci_save_model_hash: bool = flag(
        action="store_true", help="write a SHA-256 of every weight beside each checkpoint (model_hash.json)"
    )
    ci_check_model_hash: bool = flag(
        action="store_true", help="after --load, check the loaded weights against the checkpoint's hashes"
    )
    ci_save_grad_norm: str | None = flag(
        help="write each optimizer step's grad norm and loss to this path (.format fields: rollout_id, step_id, role)"
    )
    ci_load_grad_norm: str | None = flag(
        help="check each optimizer step's grad norm and loss against what --ci-save-grad-norm wrote there"
    )
    debug_rollout_only: bool = _switch()
    debug_train_only: bool = flag(
        action="store_true",
        help="train on --load-debug-rollout-data's rollouts with no rollout engine (implied by it)",
    )
    save_debug_rollout_data: str | None = flag(
        help="write each rollout's samples here (.format field: rollout_id), for --load-debug-rollout-data"
    )
    load_debug_rollout_data: str | None = flag(
        help="train on the samples --save-debug-rollout-data wrote here instead of generating any"
    )
    # tensor dumps (miles.train.dumps): the trainer hooks the training backend's model
    dumper_enable: bool = flag(
        action="store_true",
        help="dump the model's named tensors of each rollout's logprob forward (fwd_only) and training "
        "forward-backward (fwd_bwd) under --dumper-dir",
    )
    dumper_dir: str = flag(default="/tmp/dumper", help="where the dumps go: <dir>/<phase>/rollout_<k>/")
    dumper_fwd_only: tuple[str, ...] = flag(
        nargs="*",
        default=[],
        help="KEY=VALUE overrides of the fwd_only phase: enable, filter, enable_model_value, enable_model_grad",
    )
    dumper_fwd_bwd: tuple[str, ...] = flag(
        nargs="*",
        default=[],
        help="KEY=VALUE overrides of the fwd_bwd phase: enable, filter, enable_model_value, enable_model_grad",
    )
    dumper_max_bytes: int = flag(
        type=_positive_int,
        default=2**30,
        help="the most bytes of tensors a rank dumps in the run; past it, it writes no more (its manifests say so)",
    )
    dumper_inference: tuple[str, ...] = flag(
        by=(),
        why_not=_NO_ENGINE_DUMPS,
        nargs="*",
        default=[],
        help="(not supported) the rollout engine's dump phase",
    )
    dumper_source_patcher_config_train: str | None = flag(
        by=(),
        why_not="miles dumps through module hooks; editing megatron-core's source needs SGLang's source "
        "patcher, which nothing in the trainer runs",
        help="(not supported) a source patcher YAML for the training model",
    )
    dumper_source_patcher_config_inference: str | None = flag(
        by=(), why_not=_NO_ENGINE_DUMPS, help="(not supported) a source patcher YAML for the rollout engine"
    )


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
