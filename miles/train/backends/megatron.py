"""The Megatron training backend: GPU only, behind the same interface as FSDP/DDP.

What runs today everywhere: the recipe's Megatron flags are parsed (miles.train.args) and
the parallel layout they describe is validated by `miles.parallel` against the world size
and the model, before any GPU work starts, so an impossible layout (PP*EP*ETP not dividing
the world) fails in the first second with the fix named. The training itself (megatron-core
GPTModel, distributed optimizer, torch_dist checkpoints) needs CUDA or ROCm GPUs and is
not built yet; on a GPU machine the backend says so plainly instead of training silently
with something else.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from miles.train.backends import BackendUnavailable, StepResult, TrainBackend
from miles.train.batch import TokenBatch
from miles.train.layout import parallel_layout


class MegatronBackend(TrainBackend):
    def __init__(self, args, dist_info):
        world = args.actor_num_nodes * args.actor_num_gpus_per_node
        self.layout = parallel_layout(args, world)
        if dist_info.device == "cpu":
            raise BackendUnavailable(
                "--train-backend megatron needs CUDA or ROCm GPUs (megatron-core's model does not run "
                "on CPU); this machine has none. The parallel layout "
                f"{self.layout.describe()} is valid for {world} GPUs. On CPU use --train-backend fsdp or ddp."
            )
        raise BackendUnavailable(
            "--train-backend megatron: the Megatron training loop is not part of miles.train yet; "
            "its flags and parallel layout are validated. Use --train-backend fsdp on this machine."
        )

    def logprobs(self, batch: TokenBatch, *, reference: bool = False) -> object:
        raise NotImplementedError

    def train_step(self, micro_batches: Sequence[TokenBatch], normalizer: float) -> StepResult:
        raise NotImplementedError

    def full_weights(self) -> Iterator[tuple[str, object]]:
        raise NotImplementedError

    def save(self, directory: str, *, with_optimizer: bool) -> None:
        raise NotImplementedError

    def load(self, directory: str, *, with_optimizer: bool) -> None:
        raise NotImplementedError
