"""Training backends: what the trainer asks of the model that learns.

`TrainBackend` is the interface; `make_backend(config, dist)` picks FSDP2 or DDP (data
parallel over torch.distributed, any device) or Megatron (megatron-core, on GPUs or on CPU
under gloo) and gives it the configuration sections of the flags it acts on
(miles.train.consumption). The trainer never touches the wrapped model directly: how a minibatch is
dealt to the ranks and cut into micro-batches, logprobs, a training step over micro-batches,
the full weights for the rollout engine, and checkpoint state all go through here.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from miles.train import micro_batches
from miles.train.algorithm import LossTerms
from miles.train.batch import TokenBatch
from miles.train.config import BatchConfig


class BackendUnavailable(RuntimeError):
    """The chosen backend cannot run on this machine; the message says what it needs."""

    same_on_every_rank = True  # every rank builds the same backend from the same flags


@dataclass(frozen=True)
class StepResult:
    grad_norm: float
    lr: float
    terms: tuple[LossTerms, ...]  # one per micro-batch, for the metrics
    # Each micro-batch's token logprobs [rows, width-1] from the training forward (detached, on
    # the CPU), taken before the step: the policy's logprobs under the weights it started from.
    logprobs: tuple = ()
    # The loss or grad norm was not finite on some rank, so no rank applied the step
    # (miles.train.guards.step_if_finite); the trainer counts these.
    skipped: bool = False


ACTOR, CRITIC = "actor", "critic"


class TrainBackend(abc.ABC):
    # What it trains: the policy (actor), or PPO's value model (critic), whose forward gives a
    # value per token (batch_values) and whose train_step minimises the clipped value loss.
    role: str = ACTOR
    # It trains the checkpoint's MTP layers (--enable-mtp-training), whose weights then go to the
    # rollout engine with the rest.
    trains_mtp: bool = False
    # Where the frozen reference model's weights come from (None: no reference model).
    ref_source: str | None = None
    # The batch flags; each backend's constructor keeps its BatchConfig here.
    batching: BatchConfig
    # Whether a training forward computes exactly what a no-grad forward of the same micro-batch
    # does (no dropout or router noise): then the first minibatch's old logprobs are its own
    # training forward's (miles.train.trainer.learn).
    forward_is_deterministic: bool = False
    # --offload-train: moves the state off the device between phases (miles.train.offload), or None
    offloader = None

    def offload_tensors(self) -> tuple[list, list]:
        """(state, scratch) for --offload-train: the tensors holding the trainer's state between steps
        (parameters, the reference model's, the optimizer's), written out and brought back bit for
        bit, and the gradient buffers, released and brought back as zeros (every step overwrites them)."""
        raise NotImplementedError

    def dump_chunks(self) -> list:
        """The model's modules as its forward runs them (one, or one per virtual pipeline stage), for
        the tensor dumps' hooks (miles.train.dumps)."""
        raise NotImplementedError

    def sleep(self) -> None:
        """--offload-train: the state off the device until `wake_up` (while the engine generates)."""
        if self.offloader is not None:
            self.offloader.away()

    def wake_up(self) -> None:
        """The state back on the device, as it was, before a training phase."""
        if self.offloader is not None:
            self.offloader.back()

    @property
    def data_parallel(self) -> tuple[int, int, object]:
        """(rank, size, process group) of the data-parallel dimension: the ranks that train on
        different rows. Model-parallel peers (tensor, pipeline) share their rows. By default
        every rank is a replica of its own (the whole world, group None)."""
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size(), None

    @property
    def geometry(self) -> micro_batches.Geometry:
        """What a micro-batch costs here (padded width multiple, context-parallel ranks per row)."""
        return micro_batches.Geometry()

    def split_minibatch(self, lengths: Sequence[int]) -> tuple[list[int], list[list[int]]]:
        """This data-parallel rank's samples of a minibatch whose samples have `lengths` tokens
        (indices into them), and its micro-batches (positions in those samples): --micro-batch-size
        rows, or under --use-dynamic-batch-size as many rows as --max-tokens-per-gpu allows, dealt
        by token count with --balance-data (miles.train.micro_batches). Every rank derives the
        same split, and every data-parallel rank gets the same number of micro-batches."""
        rank, size, _ = self.data_parallel
        batch = self.batching
        batching = micro_batches.Batching(
            micro_batch_size=batch.micro_batch_size,
            dynamic=batch.use_dynamic_batch_size,
            max_tokens=batch.max_tokens_per_gpu,
            balance=batch.balance_data,
        )
        return micro_batches.split_minibatch(lengths, rank, size, batching, self.geometry)

    @abc.abstractmethod
    def logprobs(self, batch: TokenBatch, *, reference: bool = False) -> object:
        """Per-token logprobs [B, T-1] of the batch's targets (no gradient), policy or reference."""

    def batch_logprobs(self, micro: Sequence[TokenBatch], *, reference: bool = False) -> list:
        """Logprobs [rows, width-1] of each micro-batch (the same micro-batches, in the same shapes,
        as the training step gets)."""
        return [self.logprobs(part, reference=reference) for part in micro]

    @contextlib.contextmanager
    def scoring_temperature(self, temperature: float) -> Iterator[None]:
        """logprobs() at `temperature` instead of the rollout temperature, inside the block
        (every backend scales its logits by self.loss_cfg.temperature)."""
        saved = self.loss_cfg
        self.loss_cfg = replace(saved, temperature=temperature)
        try:
            yield
        finally:
            self.loss_cfg = saved

    def batch_values(self, micro: Sequence[TokenBatch]) -> list:
        """(critic) The value [rows, width-1] of each position of each micro-batch (no gradient)."""
        raise NotImplementedError(f"{type(self).__name__} ({self.role}) computes no values")

    @abc.abstractmethod
    def train_step(self, micro_batches: Sequence[TokenBatch], normalizer: float) -> StepResult:
        """One optimizer step over the micro-batches; each loss is divided by `normalizer`.

        The step is applied through `miles.train.guards.step_if_finite`: a non-finite loss or
        grad norm on any rank leaves weights, optimizer and schedule as they were."""

    @abc.abstractmethod
    def full_weights(self, names: str = "model", dtype=None) -> Iterator[tuple[str, object]]:
        """Unsharded weights by Hugging Face name, on every rank (for the rollout engine): the
        names of the transformers class's state dict ("model") or of the checkpoint files
        ("checkpoint"; they differ where transformers fuses a layer's experts); floating-point
        tensors in `dtype` (the engine's) when given, cast one at a time."""

    @abc.abstractmethod
    def save(self, directory: str, *, with_optimizer: bool) -> None:
        """Write model (and optimizer) state into `directory` (all ranks call it)."""

    @abc.abstractmethod
    def load(self, directory: str, *, with_optimizer: bool) -> None:
        """Restore what `save` wrote (all ranks call it)."""


def batch_loss(logp, entropy, batch: TokenBatch, cfg) -> LossTerms:
    """The GRPO/GSPO loss terms of a micro-batch from the policy's token logprobs and entropy
    (any backend's), with the batch's old, reference and rollout logprobs on their device. A
    batch without old logprobs is trained on the weights that would compute them: its old
    logprobs are this forward's own, detached (the ratio is exactly 1)."""
    from miles.train.algorithm import policy_loss

    device = logp.device
    return policy_loss(
        logp,
        entropy,
        logp.detach() if batch.old_logp is None else batch.old_logp.to(device),
        batch.advantages.to(device),
        batch.loss_mask.to(device),
        cfg,
        ref_logp=None if batch.ref_logp is None else batch.ref_logp.to(device),
        rollout_logp=batch.rollout_logp.to(device),
        sample_weight=None if batch.weights is None else batch.weights.to(device),
    )


def value_batch_loss(values, batch: TokenBatch, value_clip: float, per_token: bool):
    """PPO's clipped value loss of a micro-batch from the critic's values [rows, width-1]."""
    from miles.train.ppo import value_loss

    device = values.device
    width = values.shape[1]
    return value_loss(
        values,
        batch.old_values.to(device)[:, :width],
        batch.returns.to(device)[:, :width],
        batch.loss_mask.to(device)[:, :width],
        value_clip,
        per_token=per_token,
    )


def make_backend(config, dist_info, *, role: str = ACTOR) -> TrainBackend:
    """The --train-backend of `config` (a RunConfig), given the sections it consumes: the policy
    (`actor`), or PPO's critic (`critic`: the same model with a one-output value head)."""
    from miles import phases
    from miles.train.consumption import build

    with phases.phase(phases.INIT):
        return build("backend", config.job.train_backend, config, dist_info, role=role)
