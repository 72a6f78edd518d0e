"""Data-parallel training of a Hugging Face model with FSDP2 (`fully_shard`) or DDP.

Works on any torch.distributed backend: gloo on CPU (the CPU lane trains tiny models of
the recipes' architectures this way), NCCL/RCCL on GPUs. Each decoder layer is its own
FSDP2 unit, so parameters are gathered one layer at a time.

`--bf16` is mixed precision, the same on CPU and GPU: parameters, gradients and AdamW state
stay float32 (master weights), the forward and backward compute in bfloat16. Sharded FSDP2
does it with its MixedPrecisionPolicy (bf16 parameters gathered for compute, gradients
reduced in fp32); one rank and DDP run the forward under torch.autocast(bf16), whose
gradients land on the fp32 parameters (DDP reduces them in fp32). An optimizer on bf16
parameters would round away every update below bf16's resolution (at lr 1e-6 about 98% of
them). The frozen reference model has no optimizer and is held in bf16.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from miles.train import algorithm, guards
from miles.train.backends import StepResult, TrainBackend, batch_loss
from miles.train.batch import TokenBatch
from miles.train.config import (
    AlgorithmConfig,
    BatchConfig,
    CheckpointConfig,
    JobConfig,
    OptimizerConfig,
    RolloutConfig,
    TorchDPConfig,
    optimizer_steps,
)
from miles.train.model import is_hf_dir, load_causal_lm, train_dtype


class TorchDPBackend(TrainBackend):
    # The section fields it acts on (miles.train.consumption); the layout's model-parallel
    # degrees are refused by the flag parser, the Megatron sections are not read.
    CONSUMES = {
        "job": ("train_backend",),
        "checkpoint": ("hf_checkpoint", "ref_load"),
        "rollout": ("num_rollout", "rollout_batch_size", "n_samples_per_prompt", "rollout_temperature"),
        "batch": (
            "global_batch_size", "micro_batch_size", "use_dynamic_batch_size", "max_tokens_per_gpu", "balance_data",
        ),
        "algorithm": (
            "advantage_estimator", "eps_clip", "eps_clip_high", "eps_clip_c", "use_kl_loss", "kl_loss_type",
            "kl_loss_coef", "entropy_coef", "use_tis", "tis_clip", "tis_clip_low", "calculate_per_token_loss",
        ),
        "optimizer": (
            "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_decay_iters", "weight_decay", "adam_beta1",
            "adam_beta2", "adam_eps", "clip_grad", "bf16",
        ),
        "fsdp": "*",
    }  # fmt: skip

    def __init__(
        self,
        *,
        job: JobConfig,
        checkpoint: CheckpointConfig,
        rollout: RolloutConfig,
        batch: BatchConfig,
        algorithm: AlgorithmConfig,
        optimizer: OptimizerConfig,
        fsdp: TorchDPConfig,
        dist_info,
    ):
        self.mode = job.train_backend  # fsdp | ddp
        self.dist = dist_info
        self.batching = batch
        self.loss_cfg = algorithm.loss_config(rollout.rollout_temperature)
        self.optim_cfg = optimizer.optim_config()
        self.compute_dtype = train_dtype(optimizer.bf16)
        model = load_causal_lm(checkpoint.hf_checkpoint, dtype=torch.float32, device=dist_info.device)
        self.forward_is_deterministic = not _noisy_in_training(model)
        if fsdp.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.model = self._wrap(model, trainable=True)
        self.ref_model = None
        if algorithm.use_kl_loss:
            ref_load = checkpoint.ref_load
            ref_path = ref_load if ref_load and is_hf_dir(ref_load) else checkpoint.hf_checkpoint
            self.ref_source = ref_path
            ref = load_causal_lm(ref_path, dtype=self.compute_dtype, device=dist_info.device)
            ref.requires_grad_(False)
            self.ref_model = self._wrap(ref.eval(), trainable=False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.optim_cfg.lr,
            betas=(self.optim_cfg.beta1, self.optim_cfg.beta2),
            eps=self.optim_cfg.eps,
            weight_decay=self.optim_cfg.weight_decay,
        )
        total_steps = optimizer_steps(rollout, batch)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, self.optim_cfg, total_steps)
        )

    def _wrap(self, model, *, trainable: bool):
        if self.dist.world_size == 1:
            return model  # one rank: nothing to shard or all-reduce, and no wrapper overhead
        if self.mode == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
            layer_classes = set(getattr(model, "_no_split_modules", None) or ())
            for module in model.modules():
                if type(module).__name__ in layer_classes:
                    fully_shard(module, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            return model
        if trainable:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.dist.local_rank] if self.dist.device != "cpu" else None
            return DistributedDataParallel(model, device_ids=device_ids)
        return model

    @property
    def _inner(self):
        return getattr(self.model, "module", self.model)

    @property
    def _sharded(self) -> bool:
        return self.mode == "fsdp" and self.dist.world_size > 1

    def _compute_precision(self):
        """bf16 compute for --bf16 where FSDP2's policy does not already cast (one rank, DDP)."""
        if self.compute_dtype == torch.float32 or self._sharded:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(self.dist.device).type, dtype=self.compute_dtype)

    def _forward(self, model, batch: TokenBatch, *, with_entropy: bool):
        device = self.dist.device
        input_ids = batch.input_ids.to(device)
        attention = batch.attention_mask.to(device)
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        with self._compute_precision():
            logits = model(
                input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False
            ).logits
        return algorithm.token_logprobs_and_entropy(
            logits[:, :-1], input_ids[:, 1:], self.loss_cfg.temperature, with_entropy=with_entropy
        )

    def logprobs(self, batch: TokenBatch, *, reference: bool = False) -> torch.Tensor:
        model = self.ref_model if reference else self.model
        if model is None:
            raise RuntimeError(
                "reference logprobs asked for, but no reference model was loaded (--use-kl-loss)"
            )
        with torch.no_grad():
            logp, _ = self._forward(model, batch, with_entropy=False)
        return logp.float().cpu() * batch.loss_mask

    def train_step(self, micro_batches: Sequence[TokenBatch], normalizer: float) -> StepResult:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        terms, logps = [], []
        for i, mb in enumerate(micro_batches):
            with self._grad_sync(last=i == len(micro_batches) - 1):
                logp, entropy = self._forward(self.model, mb, with_entropy=True)
                t = batch_loss(logp, entropy, mb, self.loss_cfg)
                (t.loss / normalizer).backward()
            terms.append(t)
            logps.append(logp.detach())
        max_norm = self.optim_cfg.clip_grad if self.optim_cfg.clip_grad > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
        loss = sum(float(t.loss.detach()) for t in terms)
        skipped = guards.step_if_finite(self.optimizer, self.scheduler, loss=loss, grad_norm=float(grad_norm))
        logprobs = tuple(
            logp.float().cpu() * mb.loss_mask for logp, mb in zip(logps, micro_batches, strict=True)
        )
        return StepResult(
            grad_norm=float(grad_norm), lr=lr, terms=tuple(terms), skipped=skipped, logprobs=logprobs
        )

    def _grad_sync(self, *, last: bool):
        """Reduce gradients across ranks only on the last micro-batch of a step."""
        if self.dist.world_size == 1:
            return contextlib.nullcontext()
        if self.mode == "fsdp":
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.model.no_sync()

    def full_weights(self, names: str = "model") -> Iterator[tuple[str, torch.Tensor]]:
        if self._sharded:
            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        else:
            state = self._inner.state_dict()
        if names == "checkpoint":
            state = checkpoint_names(self._inner, state)
        yield from state.items()

    def save(self, directory: str, *, with_optimizer: bool) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state}
        if with_optimizer:
            state["optim"] = optim_state
            state["scheduler"] = {"last_epoch": torch.tensor(self.scheduler.last_epoch)}
        dcp.save(state, checkpoint_id=directory)

    def load(self, directory: str, *, with_optimizer: bool) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state}
        if with_optimizer:
            state["optim"] = optim_state
            state["scheduler"] = {"last_epoch": torch.tensor(0)}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"] if with_optimizer else {},
        )
        if with_optimizer:
            self._restore_schedule(int(state["scheduler"]["last_epoch"]))
        dist.barrier()

    def _restore_schedule(self, steps_done: int) -> None:
        self.scheduler.last_epoch = steps_done
        factor = self.scheduler.lr_lambdas[0](steps_done)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * factor


def _noisy_in_training(model) -> bool:
    """Whether the model's training forward draws random numbers (dropout, router jitter), so it
    differs from a no-grad forward of the same rows."""
    config = model.config.to_dict()
    rates = [
        v for k, v in config.items()
        if ("dropout" in k or "pdrop" in k or "jitter" in k) and isinstance(v, float | int) and not isinstance(v, bool)
    ]  # fmt: skip
    dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    return dropout or any(r > 0 for r in rates)


def checkpoint_names(model, state: dict) -> dict:
    """The state dict under the checkpoint files' names: transformers' own reversal of the
    conversions it applied when loading (fused experts split back per expert)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError as exc:
        raise RuntimeError(
            "this transformers has no revert_weight_conversion, so its in-memory names cannot be turned back "
            "into checkpoint names for the rollout engine; use the pinned transformers (requirements/<lane>.txt)"
        ) from exc
    return dict(revert_weight_conversion(model, dict(state)))


def lr_factor(step: int, cfg, total_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step `step`: linear warmup, then the decay style."""
    if cfg.lr_warmup_iters and step < cfg.lr_warmup_iters:
        return (step + 1) / cfg.lr_warmup_iters
    if cfg.lr_decay_style == "constant" or cfg.lr == 0:
        return 1.0
    decay_steps = max(1, (cfg.lr_decay_iters or total_steps) - cfg.lr_warmup_iters)
    progress = min(1.0, (step - cfg.lr_warmup_iters) / decay_steps)
    floor = cfg.min_lr / cfg.lr
    if cfg.lr_decay_style == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
