"""Data-parallel training of a Hugging Face model with FSDP2 (`fully_shard`) or DDP.

Works on any torch.distributed backend: gloo on CPU (the CPU lane trains tiny models of
the recipes' architectures this way), NCCL/RCCL on GPUs. Each decoder layer is its own
FSDP2 unit, so parameters are gathered one layer at a time. `--dp-replicate-size R` is hybrid
sharding (HSDP): a 2-D device mesh of R replicas x world/R shards, parameters sharded within a
replica and gradients all-reduced across replicas (FSDP2's own mesh form). Every rank is still
its own data-parallel rank. `--fsdp-full-params` gathers the whole state dict at once for the
rollout engine (the seed's full-params mode: fewer, larger gathers; the whole model in memory
for the hand-off) where the default gathers and hands over one tensor at a time.

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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from miles.train import algorithm, guards
from miles.train import lora as lora_adapters
from miles.train.backends import ACTOR, CRITIC, StepResult, TrainBackend, batch_loss, value_batch_loss
from miles.train.batch import TokenBatch
from miles.train.config import (
    AlgorithmConfig,
    BatchConfig,
    CheckpointConfig,
    JobConfig,
    LoraConfig,
    OptimizerConfig,
    RolloutConfig,
    TorchDPConfig,
    optimizer_steps,
)
from miles.train.model import (
    ModelLoadError,
    empty_causal_lm,
    is_hf_dir,
    load_causal_lm,
    train_dtype,
    with_value_head,
)


class TorchDPBackend(TrainBackend):
    # It is built from the sections of the flags that name it (miles.train.config: by=fsdp/ddp);
    # the layout's model-parallel degrees are refused by the flag parser.

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
        lora: LoraConfig,
        dist_info,
        role: str = ACTOR,
    ):
        self.mode = job.train_backend  # fsdp | ddp
        self.dist = dist_info
        self.role = role
        self.lora = lora if lora.enabled and role == ACTOR else None  # adapters on the policy only
        self.hf_checkpoint = checkpoint.hf_checkpoint
        self.batching = batch
        self.loss_cfg = algorithm.loss_config(rollout.rollout_temperature)
        self.value_clip = algorithm.value_clip
        self.optim_cfg = optimizer.optim_config(algorithm, critic=role == CRITIC)
        self.compute_dtype = train_dtype(optimizer.bf16)
        self.replicas, self.full_params = fsdp.dp_replicate_size, fsdp.fsdp_full_params
        self._mesh = None
        self._groups: dict[str, frozenset[str]] | None = None
        self.model = self._load(
            checkpoint.hf_checkpoint, torch.float32, trainable=True, checkpointing=fsdp.gradient_checkpointing
        )
        self.forward_is_deterministic = not _noisy_in_training(self._inner)
        # --use-rollout-routing-replay: the policy's routers take the rollout engine's experts (the
        # reference model and the critic route by their own top-k, as the seed framework's do)
        self.routing = None
        if rollout.use_rollout_routing_replay and role == ACTOR:
            from miles.train.routing_replay import router_hooks

            self.routing = router_hooks(self._inner)
        self.ref_model = None
        if algorithm.use_kl_loss and role == ACTOR:
            ref_load = checkpoint.ref_load
            ref_path = ref_load if ref_load and is_hf_dir(ref_load) else checkpoint.hf_checkpoint
            self.ref_source = ref_path
            self.ref_model = self._load(ref_path, self.compute_dtype, trainable=False)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # with LoRA: the adapters
            lr=self.optim_cfg.lr,
            betas=(self.optim_cfg.beta1, self.optim_cfg.beta2),
            eps=self.optim_cfg.eps,
            weight_decay=self.optim_cfg.weight_decay,
        )
        total_steps = optimizer_steps(rollout, batch)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, self.optim_cfg, total_steps)
        )
        from miles.train import offload

        streamed = offload.setup(job, self, dist_info.rank, [self.optimizer])
        self.streamed = streamed[0] if streamed else None

    def _load(self, path: str, dtype, *, trainable: bool, checkpointing: bool = False):
        """The model of `path` in `dtype`, wrapped. Sharded, no rank holds it whole on its device:
        every rank builds it empty and shards it, rank 0 reads the checkpoint into host memory,
        and each tensor is broadcast in turn, every rank keeping its own shard of it."""
        if not self._sharded:
            model = self._headed(load_causal_lm(path, dtype=dtype, device=self.dist.device), trainable)
            if checkpointing:
                model.gradient_checkpointing_enable()
            return self._wrap(model if trainable else model.requires_grad_(False).eval(), trainable=trainable)
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        source, failed = None, [None]
        if self.dist.rank == 0:
            try:
                source = self._headed(load_causal_lm(path, dtype=dtype, device="cpu"), trainable)
            except ModelLoadError as exc:
                failed = [str(exc)]
        # the other ranks would wait for rank 0's tensors forever: every rank raises its error
        dist.broadcast_object_list(failed, src=0)
        if failed[0] is not None:
            raise ModelLoadError(failed[0])
        model = self._headed(empty_causal_lm(path, dtype=dtype), trainable)
        if checkpointing:
            model.gradient_checkpointing_enable()
        if not trainable:
            model.requires_grad_(False).eval()
        self._shard(model)
        model.to_empty(device=self.dist.device)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, source.state_dict() if source is not None else {}, options=options)
        # buffers the state dict leaves out (rotary frequencies) were built on the meta device
        held = dict(source.named_buffers()) if source is not None else {}
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if source is not None:
                    buffer.copy_(held[name])
                dist.broadcast(buffer, src=0)
        # the renamings transformers applied while loading, which checkpoint_names reverts
        # (a model built from its config alone gets the defaults, without the legacy ones)
        conversions = [getattr(source, "_weight_conversions", None)]
        dist.broadcast_object_list(conversions, src=0)
        if conversions[0] is not None:
            model._weight_conversions = conversions[0]
        return model

    def _headed(self, model, trainable: bool):
        """The critic's model is the policy's with a value head (miles.train.model.with_value_head);
        with --lora-rank the policy is wrapped with adapters (miles.train.lora)."""
        if not trainable:
            return model
        if self.role == CRITIC:
            return with_value_head(model)
        return lora_adapters.wrap(model, self.lora, self.hf_checkpoint) if self.lora else model

    def _shard(self, model) -> None:
        """FSDP2 over every decoder layer, then the rest of the model as the root unit."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        mesh = self._device_mesh()
        layer_classes = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)

    def _device_mesh(self):
        """The 2-D (replicate, shard) mesh of --dp-replicate-size, built once; None for plain FSDP
        (FSDP2 then shards over every rank). Ranks r*S..r*S+S-1 hold replica r's shards."""
        if self.replicas == 1:
            return None
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            shards = self.dist.world_size // self.replicas
            device = torch.device(self.dist.device).type
            self._mesh = init_device_mesh(
                device, (self.replicas, shards), mesh_dim_names=("dp_replicate", "dp_shard")
            )
            if self.dist.is_main:
                print(
                    f"miles.train: fsdp hybrid sharding: {self.replicas} replicas x {shards} shards "
                    "(device mesh dp_replicate x dp_shard)",
                    flush=True,
                )
        return self._mesh

    def _wrap(self, model, *, trainable: bool):
        if self.dist.world_size == 1:
            return model  # one rank: nothing to shard or all-reduce, and no wrapper overhead
        if trainable:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.dist.local_rank] if self.dist.device != "cpu" else None
            return DistributedDataParallel(model, device_ids=device_ids)
        return model

    def dump_chunks(self) -> list:
        return [getattr(self.model, "module", self.model)]  # DDP's wrapper would prefix every name

    @property
    def _inner(self):
        """The transformers model (under DDP's wrapper and PEFT's, when there)."""
        model = getattr(self.model, "module", self.model)
        return model.get_base_model() if self.lora else model

    def _state_items(self):
        """The model's tensors under the transformers class's names; with LoRA, each adapted
        weight merged with its adapters (a new tensor: the frozen base is never changed)."""
        items = self._inner.state_dict().items()
        return lora_adapters.merged(items, self.lora.scaling) if self.lora else items

    @property
    def _sharded(self) -> bool:
        return self.mode == "fsdp" and self.dist.world_size > 1

    def _compute_precision(self):
        """bf16 compute for --bf16 where FSDP2's policy does not already cast (one rank, DDP)."""
        if self.compute_dtype == torch.float32 or self._sharded:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(self.dist.device).type, dtype=self.compute_dtype)

    def _logits(self, model, batch: TokenBatch):
        device = self.dist.device
        input_ids = batch.input_ids.to(device)
        attention = batch.attention_mask.to(device)
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        with self._compute_precision():
            return model(
                input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False
            ).logits

    def _forward(self, model, batch: TokenBatch, *, with_entropy: bool):
        logits = self._logits(model, batch)
        return algorithm.token_logprobs_and_entropy(
            logits[:, :-1],
            batch.input_ids.to(logits.device)[:, 1:],
            self.loss_cfg.temperature,
            with_entropy=with_entropy,
        )

    def _values(self, batch: TokenBatch):
        """The critic's value [rows, width-1] at each position (before each target token)."""
        return self._logits(self.model, batch)[:, :-1, 0].float()

    def batch_values(self, micro: Sequence[TokenBatch]) -> list[torch.Tensor]:
        with torch.no_grad():
            return [self._values(mb).cpu() * mb.loss_mask for mb in micro]

    def logprobs(self, batch: TokenBatch, *, reference: bool = False) -> torch.Tensor:
        model = self.ref_model if reference else self.model
        if model is None:
            raise RuntimeError(
                "reference logprobs asked for, but no reference model was loaded (--use-kl-loss)"
            )
        with torch.no_grad(), self._replaying(batch, model):
            logp, _ = self._forward(model, batch, with_entropy=False)
        return logp.float().cpu() * batch.loss_mask

    def _replaying(self, batch: TokenBatch, model=None):
        """The policy's forward (and backward) of `batch` with its routers replaying the batch's
        routed experts, under --use-rollout-routing-replay."""
        if self.routing is None or (model is not None and model is not self.model):
            return contextlib.nullcontext()
        if batch.routed_experts is None:
            from miles.train.routing_replay import RoutingReplayError

            raise RoutingReplayError(
                "--use-rollout-routing-replay: a training batch came without the rollout engine's routed experts"
            )
        return self.routing.replaying(batch.routed_experts.to(self.dist.device))

    def train_step(self, micro_batches: Sequence[TokenBatch], normalizer: float) -> StepResult:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        terms, logps = [], []
        for i, mb in enumerate(micro_batches):
            with self._grad_sync(last=i == len(micro_batches) - 1), self._replaying(mb):
                if self.role == CRITIC:
                    logp = self._values(mb)  # the critic's "logprobs" are its values
                    t = value_batch_loss(logp, mb, self.value_clip, self.loss_cfg.per_token_loss)
                else:
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

    def full_weights(self, names: str = "model", dtype=None) -> Iterator[tuple[str, torch.Tensor]]:
        """One tensor at a time: sharded, each is gathered (all ranks take part), cast to `dtype`
        and handed out before the next is gathered, so no rank holds the whole model at once
        (with --fsdp-full-params every tensor is gathered first, then handed out). Checkpoint names are given tensor by tensor too, except where transformers split one
        checkpoint tensor into several model tensors (hrm_text's gate_up_proj): those are held
        until the last of their group is gathered, then reverted together."""
        groups = self._revert_groups() if names == "checkpoint" else {}
        pending: dict[frozenset[str], dict[str, torch.Tensor]] = {}
        gathered = self._gathered(dtype)
        if self.full_params:
            gathered = list(gathered)  # every tensor gathered before the first is handed over
        for name, tensor in gathered:
            if names != "checkpoint":
                yield name, tensor
            elif name not in groups:
                yield from checkpoint_names(self._inner, {name: tensor}).items()
            else:
                held = pending.setdefault(groups[name], {})
                held[name] = tensor
                if len(held) == len(groups[name]):
                    yield from checkpoint_names(self._inner, pending.pop(groups[name])).items()

    def _gathered(self, dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor of the state dict unsharded (all ranks take part), detached, in `dtype`
        (with LoRA, each adapted weight merged with its adapters)."""
        for name, tensor in self._state_items():
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            tensor = tensor.detach()
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            yield name, tensor

    def _revert_groups(self) -> dict[str, frozenset[str]]:
        """The model tensors whose checkpoint tensor only they together give back, each mapped to
        its group (worked out once, on meta tensors): a tensor is reverted alone where that yields
        the names and shapes reverting the whole state dict gives it, and no other tensor does."""
        if self._groups is None:
            meta = {
                name: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
                for name, t in self._state_items()
            }
            whole = {n: tuple(t.shape) for n, t in checkpoint_names(self._inner, dict(meta)).items()}
            alone = {
                name: {n: tuple(t.shape) for n, t in checkpoint_names(self._inner, {name: t}).items()}
                for name, t in meta.items()
            }
            makers: dict[str, set[str]] = {}
            for name, made in alone.items():
                for n in made:
                    makers.setdefault(n, set()).add(name)
            self._groups = {}
            for name, made in alone.items():
                if any(whole.get(n) != shape or len(makers[n]) > 1 for n, shape in made.items()):
                    self._groups[name] = frozenset(m for n in made for m in makers[n])
        return self._groups

    def offload_tensors(self) -> tuple[list, list]:
        models = [self.model] + ([self.ref_model] if self.ref_model is not None else [])
        state = [p for model in models for p in model.parameters()]
        state += [
            v
            for held in self.optimizer.state.values()
            for v in held.values()
            if torch.is_tensor(v) and v.dim()
        ]
        return state, [p.grad for p in self.model.parameters() if p.grad is not None]

    def _optimizer_resident(self):
        """--stream-optimizer-state-to-disk: the optimizer state in memory inside the block."""
        return self.streamed.resident() if self.streamed is not None else contextlib.nullcontext()

    def save(self, directory: str, *, with_optimizer: bool) -> None:
        with self._optimizer_resident():
            self._save(directory, with_optimizer=with_optimizer)

    def _save(self, directory: str, *, with_optimizer: bool) -> None:
        # with LoRA: the adapters only (the base is --hf-checkpoint's), and their PEFT-format copy
        model_state, optim_state = self._state()
        if self.lora:
            self._save_adapter(f"{directory}/{lora_adapters.ADAPTER_DIR}")
        state = {"model": model_state}
        if with_optimizer:
            state["optim"] = optim_state
            state["scheduler"] = {"last_epoch": torch.tensor(self.scheduler.last_epoch)}
        dcp.save(state, checkpoint_id=directory)

    def _state(self) -> tuple[dict, dict]:
        """Model and optimizer state to checkpoint; with LoRA the adapters' alone (a head tied to
        the frozen embedding is a key of the state dict that names no frozen parameter, so the
        adapters are picked by name)."""
        options = StateDictOptions(ignore_frozen_params=self.lora is not None)
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        if self.lora:
            model_state = {k: v for k, v in model_state.items() if lora_adapters.is_adapter(k)}
        return model_state, optim_state

    def _save_adapter(self, directory: str) -> None:
        """The adapters, gathered whole on rank 0, as PEFT saves them (all ranks call it)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        full = {
            k: v
            for k, v in get_model_state_dict(self.model, options=options).items()
            if lora_adapters.is_adapter(k)
        }
        if self.dist.rank == 0:
            lora_adapters.save_adapter(directory, full, self.lora, self.hf_checkpoint)

    def load(self, directory: str, *, with_optimizer: bool) -> None:
        with self._optimizer_resident():
            self._load_state(directory, with_optimizer=with_optimizer)
        dist.barrier()

    def _load_state(self, directory: str, *, with_optimizer: bool) -> None:
        model_state, optim_state = self._state()
        state = {"model": model_state}
        if with_optimizer:
            state["optim"] = optim_state
            state["scheduler"] = {"last_epoch": torch.tensor(0)}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(
            self.model,
            self.optimizer,
            options=StateDictOptions(strict=self.lora is None),
            model_state_dict=state["model"],
            optim_state_dict=state["optim"] if with_optimizer else {},
        )
        if with_optimizer:
            self._restore_schedule(int(state["scheduler"]["last_epoch"]))

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
