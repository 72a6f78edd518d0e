"""The batch, algorithm, optimizer and FSDP/DDP sections: how the samples become optimizer steps."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from miles.train.config.flags import (
    DATA_PARALLEL,
    EVERY_BACKEND,
    TORCH,
    TORCH_SERVERS,
    TRAINER,
    TRAINER_AND_BACKENDS,
    Section,
    _non_negative_float,
    _positive_int,
    _switch,
    flag,
)

ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "ppo")
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")


@dataclass(frozen=True)
class LossConfig:
    advantage_estimator: str
    eps_clip: float
    eps_clip_high: float
    eps_clip_c: float | None  # dual-clip bound for negative advantages; None = off
    use_kl_loss: bool
    kl_loss_type: str
    kl_loss_coef: float
    entropy_coef: float
    use_tis: bool
    tis_clip: float
    tis_clip_low: float
    per_token_loss: bool
    temperature: float  # logits are divided by it so trainer and rollout logprobs agree


@dataclass(frozen=True)
class OptimConfig:
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_warmup_iters: int
    lr_decay_iters: int | None
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    clip_grad: float


@dataclass(frozen=True)
class BatchConfig(Section):
    """How a rollout's samples are cut into optimizer steps and micro-batches."""

    name: ClassVar[str] = "batch"
    title: ClassVar[str] = "training batches"
    used_by: ClassVar[tuple[str, ...]] = EVERY_BACKEND

    global_batch_size: int | None = flag(
        by=TRAINER_AND_BACKENDS, type=_positive_int, help="samples per optimizer step (all ranks)"
    )
    allow_partial_train_step: bool = flag(
        by=TRAINER,
        action="store_true",
        help="train the samples of a rollout past its last whole global batch as one smaller final step "
        "(needs the trim disabled); its loss is normalised by its own sample or token count",
    )
    disable_rollout_trim_samples: bool = flag(
        by=TRAINER, action="store_true", help="keep the samples of a rollout past its last whole global batch"
    )
    micro_batch_size: int = flag(
        type=_positive_int, default=8, help="samples per forward per rank (unless dynamic batch size)"
    )
    balance_data: bool = flag(
        action="store_true", help="deal a step's samples to data-parallel ranks by token count"
    )
    use_dynamic_batch_size: bool = flag(
        action="store_true", help="fill each forward up to --max-tokens-per-gpu"
    )
    max_tokens_per_gpu: int | None = flag(
        type=_positive_int,
        help="padded tokens (rows x widest row) per forward per GPU and context-parallel rank; a longer sample "
        "runs alone; without dynamic batch size, a ceiling on the micro-batch size",
    )


@dataclass(frozen=True)
class AlgorithmConfig(Section):
    name: ClassVar[str] = "algorithm"
    title: ClassVar[str] = "algorithm"
    # the loss terms: the backends train with them, the trainer states the first step's statistics
    used_by: ClassVar[tuple[str, ...]] = TRAINER_AND_BACKENDS

    advantage_estimator: str = flag(default="grpo", choices=ADVANTAGE_ESTIMATORS)
    disable_grpo_std_normalization: bool = flag(
        by=TRAINER, action="store_true", help="Dr. GRPO: no std division"
    )
    eps_clip: float = flag(type=_non_negative_float, default=0.2)
    eps_clip_high: float | None = flag(type=_non_negative_float, help="upper clip (default: --eps-clip)")
    eps_clip_c: float | None = flag(type=float, help="dual-clip constant (> 1) for negative advantages")
    use_kl_loss: bool = flag(action="store_true", help="add a KL loss against the frozen reference")
    kl_loss_type: str = flag(default="low_var_kl", choices=KL_LOSS_TYPES)
    kl_loss_coef: float = flag(type=_non_negative_float, default=0.0)
    kl_coef: float = flag(by=(), type=_non_negative_float, default=0.0, help="KL in the reward (must be 0)")
    entropy_coef: float = flag(type=_non_negative_float, default=0.0)
    use_tis: bool = flag(action="store_true", help="truncated importance sampling vs rollout logprobs")
    tis_clip: float = flag(type=_non_negative_float, default=2.0)
    tis_clip_low: float = flag(type=_non_negative_float, default=0.0)
    calculate_per_token_loss: bool = flag(action="store_true", help="average over tokens, not samples")
    use_rollout_logprobs: bool = flag(
        by=TRAINER, action="store_true", help="old logprobs from the rollout engine"
    )
    normalize_advantages: bool = flag(
        by=TRAINER, action="store_true", help="whiten the advantages over every rank's response tokens"
    )
    # PPO (--advantage-estimator ppo): a critic, its own model trained beside the policy
    gamma: float = flag(by=TRAINER, type=_non_negative_float, default=1.0, help="(ppo) GAE discount")
    lambd: float = flag(by=TRAINER, type=_non_negative_float, default=1.0, help="(ppo) GAE lambda")
    value_clip: float = flag(
        by=EVERY_BACKEND,
        type=_non_negative_float,
        default=0.2,
        help="(ppo) how far a value may move from its old one",
    )
    critic_lr: float | None = flag(
        by=EVERY_BACKEND, type=_non_negative_float, help="(ppo) the critic's learning rate (default: --lr)"
    )
    critic_lr_warmup_iters: int = flag(
        by=EVERY_BACKEND, type=int, default=0, help="(ppo) the critic's warmup steps"
    )
    num_critic_only_steps: int = flag(
        by=TRAINER,
        type=int,
        default=0,
        help="(ppo) first rollouts that train only the critic (the policy waits)",
    )

    # on-policy distillation: a teacher scores the policy's samples (miles.train.distillation)
    use_opd: bool = flag(
        by=TRAINER, action="store_true", help="train towards a teacher's per-token log-probs"
    )
    opd_type: str | None = flag(
        by=TRAINER, choices=("sglang", "megatron"), help="sglang: the teacher at --rm-url"
    )
    opd_kl_coef: float = flag(by=TRAINER, type=_non_negative_float, default=1.0)
    opd_log_prob_top_k: int = flag(by=TRAINER, type=int, default=0, help="0: the sampled token's reverse KL")
    opd_top_k_strategy: str = flag(
        by=TRAINER,
        default="only-student",
        choices=("only-student", "only-teacher", "intersection", "union", "xor"),
    )
    opd_reward_weight_mode: str = flag(
        by=TRAINER, default="student_p", choices=("student_p", "teacher_p", "none")
    )

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator == "ppo"

    def loss_config(self, temperature: float) -> LossConfig:
        """The loss terms' settings; `temperature` is the rollout's, so trainer and engine logprobs agree."""
        return LossConfig(
            advantage_estimator=self.advantage_estimator,
            eps_clip=self.eps_clip,
            eps_clip_high=self.eps_clip if self.eps_clip_high is None else self.eps_clip_high,
            eps_clip_c=self.eps_clip_c,
            use_kl_loss=self.use_kl_loss,
            kl_loss_type=self.kl_loss_type,
            kl_loss_coef=self.kl_loss_coef,
            entropy_coef=self.entropy_coef,
            use_tis=self.use_tis,
            tis_clip=self.tis_clip,
            tis_clip_low=self.tis_clip_low,
            per_token_loss=self.calculate_per_token_loss,
            temperature=temperature,
        )


@dataclass(frozen=True)
class OptimizerConfig(Section):
    name: ClassVar[str] = "optimizer"
    title: ClassVar[str] = "optimizer"
    used_by: ClassVar[tuple[str, ...]] = EVERY_BACKEND

    optimizer: str = flag(by=(), default="adam", choices=("adam",), help="AdamW (decoupled weight decay)")
    lr: float = flag(type=_non_negative_float, default=1e-6)
    min_lr: float = flag(type=_non_negative_float, default=0.0)
    lr_decay_style: str = flag(default="constant", choices=("constant", "linear", "cosine"))
    lr_warmup_iters: int = flag(type=int, default=0)
    lr_decay_iters: int | None = flag(type=_positive_int)
    weight_decay: float = flag(type=_non_negative_float, default=0.0)
    adam_beta1: float = flag(type=float, default=0.9)
    adam_beta2: float = flag(type=float, default=0.999)
    adam_eps: float = flag(type=float, default=1e-8)
    clip_grad: float = flag(type=_non_negative_float, default=1.0, help="max grad norm; 0 = off")
    max_skipped_steps: int = flag(
        by=TRAINER,
        type=int,
        default=3,
        help="stop after this many optimizer steps in a row skipped for a non-finite loss or grad norm; 0 = never",
    )
    # the built-in engine samples in the trainer's compute dtype, so it scores what the trainer does
    bf16: bool = flag(
        by=(*EVERY_BACKEND, TORCH, TORCH_SERVERS),
        action="store_true",
        help="bfloat16 compute with float32 master weights, gradient reduction and optimizer state",
    )
    fp16: bool = _switch(by=())

    def optim_config(self, algorithm: AlgorithmConfig | None = None, *, critic: bool = False) -> OptimConfig:
        """The optimizer's settings; the critic's (PPO) take --critic-lr and --critic-lr-warmup-iters."""
        if critic and algorithm is not None:
            lr = self.lr if algorithm.critic_lr is None else algorithm.critic_lr
            return replace(self.optim_config(), lr=lr, lr_warmup_iters=algorithm.critic_lr_warmup_iters)
        return OptimConfig(
            lr=self.lr,
            min_lr=self.min_lr,
            lr_decay_style=self.lr_decay_style,
            lr_warmup_iters=self.lr_warmup_iters,
            lr_decay_iters=self.lr_decay_iters,
            weight_decay=self.weight_decay,
            beta1=self.adam_beta1,
            beta2=self.adam_beta2,
            eps=self.adam_eps,
            clip_grad=self.clip_grad,
        )


@dataclass(frozen=True)
class TorchDPConfig(Section):
    """Options only the data-parallel backends (FSDP2, DDP) act on."""

    name: ClassVar[str] = "fsdp"
    title: ClassVar[str] = "fsdp/ddp backend"
    used_by: ClassVar[tuple[str, ...]] = DATA_PARALLEL

    gradient_checkpointing: bool = flag(action="store_true", help="(fsdp/ddp) recompute activations")
    dp_replicate_size: int = flag(
        type=_positive_int,
        default=1,
        help="(fsdp) hybrid sharding: replicas of the model, each sharded over world/N ranks (a 2-D device mesh)",
    )
    fsdp_full_params: bool = flag(
        action="store_true",
        help="(fsdp) gather the whole state dict at once for the rollout engine, not one tensor at a time",
    )


@dataclass(frozen=True)
class LoraConfig(Section):
    """LoRA adapters on the policy (the seed framework's flags): only they train, the base stays frozen."""

    name: ClassVar[str] = "lora"
    title: ClassVar[str] = "LoRA adapters"
    used_by: ClassVar[tuple[str, ...]] = EVERY_BACKEND

    lora_rank: int = flag(type=int, default=0, help="adapter rank; 0 = no LoRA, the whole model trains")
    lora_alpha: int = flag(type=int, default=16, help="the adapters' scale is alpha / rank")
    lora_dropout: float = flag(type=_non_negative_float, default=0.0)
    target_modules: str | None = flag(
        help="all-linear (default), or module names, comma-separated, in HF spelling (q_proj, ...) or Megatron's "
        "(linear_qkv, linear_proj, linear_fc1, linear_fc2)"
    )

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def scaling(self) -> float:
        """What B @ A is multiplied by (peft's scaling without rsLoRA)."""
        return self.lora_alpha / self.lora_rank
