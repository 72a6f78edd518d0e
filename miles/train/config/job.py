"""The job and parallel-layout sections: which backend and engine run, on how many GPUs, how split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from miles.train.config.flags import (
    DATA_PARALLEL,
    EVERY_BACKEND,
    MEGATRON,
    SGLANG,
    SGLANG_SERVERS,
    TORCH_SERVERS,
    TRAINER,
    Section,
    _positive_int,
    _switch,
    flag,
)

TRAIN_BACKENDS = ("fsdp", "ddp", "megatron")
ROLLOUT_ENGINES = ("auto", "torch", "sglang")

# Why no component acts on a flag, where a reader would not guess it.
_IN_PROCESS = (
    "the built-in engine samples inside the trainer's processes and holds no GPU memory of its own to place or "
    "release"
)


@dataclass(frozen=True)
class JobConfig(Section):
    """Which backend and engine run, on how many GPUs, where, and the run's seed."""

    name: ClassVar[str] = "job"
    title: ClassVar[str] = "job (backend, engine, GPUs, placement, seed)"
    used_by: ClassVar[tuple[str, ...]] = (TRAINER,)

    train_backend: str = flag(by=(TRAINER, *DATA_PARALLEL), default="fsdp", choices=TRAIN_BACKENDS)
    rollout_engine: str = flag(default="auto", choices=ROLLOUT_ENGINES, help="auto: sglang on GPU")
    distributed_backend: str | None = flag(choices=("gloo", "nccl"), help="default: nccl on GPU, else gloo")
    # SGLang servers are placed on the GPUs after the training ones of the trainer's node
    actor_num_nodes: int = flag(by=(TRAINER, SGLANG_SERVERS), type=_positive_int, default=1)
    actor_num_gpus_per_node: int = flag(by=(TRAINER, SGLANG_SERVERS), type=_positive_int, default=1)
    rollout_num_gpus: int | None = flag(
        by=(TORCH_SERVERS, SGLANG_SERVERS),
        why_not="with --colocate the rollout shares the training devices (drop --colocate to give it its own)",
        type=_positive_int,
        help="devices of the rollout's own (engines in processes of their own, without --colocate)",
    )
    colocate: bool = flag(
        by=SGLANG, why_not=_IN_PROCESS, action="store_true", help="rollout and training share the GPUs"
    )
    offload: bool = flag(
        by=(*EVERY_BACKEND, SGLANG), action="store_true", help="--offload-train and --offload-rollout"
    )
    offload_train: bool = flag(
        by=EVERY_BACKEND,
        action="store_true",
        help="move the trainer's weights, gradients and optimizer state off the device while the engine generates",
    )
    offload_rollout: bool = _switch(by=SGLANG, why_not=_IN_PROCESS)
    offload_train_target: str = flag(
        by=EVERY_BACKEND,
        default="cpu",
        choices=("cpu", "disk"),
        help="where --offload-train puts the trainer's state: host memory or disk",
    )
    offload_train_disk_dir: str | None = flag(
        by=EVERY_BACKEND,
        help="(disk offload, optimizer streaming) a fast local directory, one rank<R>/ each; default "
        "$SCRATCH/miles_train_offload_<uid>",
    )
    offload_train_disk_chunk_mb: int = flag(
        by=EVERY_BACKEND,
        type=_positive_int,
        default=256,
        help="(disk offload, optimizer streaming) MiB per chunk file / bucket",
    )
    stream_optimizer_state_to_disk: bool = flag(
        by=EVERY_BACKEND,
        action="store_true",
        help="keep the optimizer state on disk, also during the step: the step reads and writes it bucket by bucket",
    )
    seed: int = flag(by=(TRAINER, MEGATRON), type=int, default=1234)
    num_threads: int | None = flag(type=_positive_int, help="torch intra-op threads per rank (CPU)")
    deterministic_mode: bool = flag(
        by=(TRAINER, MEGATRON),
        action="store_true",
        help="deterministic kernels: a rerun with the same seed and layout is bit-identical",
    )
    debug_deterministic_collective: bool = flag(
        action="store_true",
        help="(debugging; slow) all-reduce and reduce-scatter as an all-gather and a fixed-order sum "
        "(miles.train.deterministic)",
    )

    @property
    def world_size(self) -> int:
        """The ranks the job asks for: --actor-num-nodes x --actor-num-gpus-per-node."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node


@dataclass(frozen=True)
class ParallelFlags(Section):
    """The parallel layout's flags; the run carries them as one `ParallelLayout` (RunConfig.layout),
    resolved once by miles.parallel."""

    name: ClassVar[str] = "layout"
    title: ClassVar[str] = "parallel layout (megatron backend)"
    used_by: ClassVar[tuple[str, ...]] = (MEGATRON,)

    tensor_model_parallel_size: int = flag(type=_positive_int, default=1)
    pipeline_model_parallel_size: int = flag(type=_positive_int, default=1)
    context_parallel_size: int = flag(type=_positive_int, default=1)
    expert_model_parallel_size: int = flag(type=_positive_int, default=1)
    expert_tensor_parallel_size: int | None = flag(type=_positive_int, help="default: the TP size")
    sequence_parallel: bool = _switch()
    decoder_first_pipeline_num_layers: int | None = flag(type=_positive_int)
    decoder_last_pipeline_num_layers: int | None = flag(type=_positive_int)
    num_layers_per_virtual_pipeline_stage: int | None = flag(type=_positive_int)
    num_virtual_stages_per_pipeline_rank: int | None = flag(type=_positive_int, help="virtual pipeline (vpp)")
    cp_comm_type: str | None = flag(choices=("p2p", "a2a", "all_gather", "allgather", "a2a+p2p"))
