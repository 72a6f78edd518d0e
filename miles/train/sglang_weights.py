"""How trained weights reach a colocated SGLang engine (sglang 0.5.23's contract).

An engine of N GPUs is served by the N training ranks on those GPUs (its group, leader
first). Every rank holds the full weights, so every rank packs the same bucket of tensors
into one flat buffer on its own GPU (`FlattenedTensorBucket`) and serializes it
(`MultiprocessingSerializer`: a CUDA IPC handle, not the bytes). The leader gathers the N
payloads over the group's gloo group and hands them to the engine as
`update_weights_from_tensor(load_format="flattened_bucket")`: engine rank r opens payload r,
which lives on its own GPU (sglang's `TpModelWorker.deserialize_own_rank`), so nothing
crosses GPUs and one IPC handle moves a whole bucket. Every rank keeps its buffer until the
leader has the engine's answer, which the leader shares with the group: all ranks fail
together, none waits in a collective for a rank that already stopped.

The engine loads tensors only inside a weight-update session (sglang's
`SchedulerWeightUpdaterManager.update_weights_from_tensor` answers success=False outside
one), and `end_weight_update` is where quantized and ROCm-shuffled weights are processed
into kernel layout. Around a push the leader pauses generation (`retract`: nothing runs,
nothing is lost), flushes the KV cache computed with the old weights, opens the session,
loads the buckets, closes it and lets generation continue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from miles.train.rollout import RolloutEngineError

# A follower waits for its leader's whole generation inside this group's collectives: gloo
# (no NCCL watchdog) with a limit far above any rollout the recipes run.
FOLLOWER_TIMEOUT = timedelta(hours=6)
FLATTENED = "flattened_bucket"  # sglang's load_format for FlattenedTensorBucket payloads


@dataclass
class EngineGroup:
    """The training ranks one engine serves, with the gloo group they talk over."""

    ranks: tuple[int, ...]  # leader first
    rank: int
    group: Any = None  # torch.distributed gloo group; None for an engine of one GPU

    @property
    def leader(self) -> bool:
        return self.rank == self.ranks[0]

    def exchange(self, mine, compute: Callable[[list], Any]):
        """Gather every member's `mine` at the leader, run `compute(all of them)` there, and return
        its result on every member; an error there is raised everywhere, with the leader's message."""
        if self.group is None:
            return _unwrap(_outcome(compute, [mine]))
        import torch.distributed as dist

        gathered = [None] * len(self.ranks) if self.leader else None
        dist.gather_object(mine, gathered, dst=self.ranks[0], group=self.group)
        box = [_outcome(compute, gathered) if self.leader else None]
        dist.broadcast_object_list(box, src=self.ranks[0], group=self.group)
        return _unwrap(box[0])


def _outcome(compute, gathered) -> tuple[str, Any]:
    try:
        return "ok", compute(gathered)
    except RolloutEngineError as exc:
        return "error", str(exc)


def _unwrap(outcome: tuple[str, Any]):
    kind, value = outcome
    if kind == "error":
        raise RolloutEngineError(value)
    return value


def engine_groups(world_size: int, gpus_per_engine: int, rank: int) -> EngineGroup:
    """This rank's engine group. Every rank creates every group (torch requires it); an engine's
    ranks are consecutive (engine_slot tiles each node's GPUs)."""
    first = rank - rank % gpus_per_engine
    ranks = tuple(range(first, first + gpus_per_engine))
    if gpus_per_engine == 1 or world_size == 1:
        return EngineGroup(ranks, rank)
    import torch.distributed as dist

    mine = None
    for start in range(0, world_size, gpus_per_engine):
        group = dist.new_group(
            list(range(start, start + gpus_per_engine)), backend="gloo", timeout=FOLLOWER_TIMEOUT
        )
        if start == first:
            mine = group
    return EngineGroup(ranks, rank, mine)


def buckets(
    named_tensors: Iterable[tuple[str, object]], limit_bytes: int
) -> Iterator[list[tuple[str, object]]]:
    """Consecutive tensors in groups of about `limit_bytes` (a tensor larger than that is alone)."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= limit_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def serialize_bucket(bucket: list[tuple[str, object]]) -> tuple[bytes, object]:
    """(this rank's payload, the flat buffer it points to); keep the buffer until the engine loaded it."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    flat = FlattenedTensorBucket(named_tensors=[(n, t.detach()) for n, t in bucket])
    data = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    if data["flattened_tensor"].is_cuda:
        # CUDA IPC handles then name the GPU by UUID, so trainer and engine may number GPUs
        # differently (sglang's patch handles CUDA tensors only)
        monkey_patch_torch_reductions()
    return MultiprocessingSerializer.serialize(data), data["flattened_tensor"]


def checked(what: str, result) -> None:
    """sglang answers control calls with (success, message) or an object carrying them."""
    if isinstance(result, tuple):
        success, message = result[0], result[1] if len(result) > 1 else ""
    else:
        success, message = getattr(result, "success", True), getattr(result, "message", "")
    if not success:
        raise RolloutEngineError(f"SGLang refused {what}: {message or 'no message'}")
