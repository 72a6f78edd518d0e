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

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from miles.train.backends import BackendUnavailable, StepResult, TrainBackend
from miles.train.batch import TokenBatch


def parallel_layout(args, world_size: int):
    """The `miles.parallel.ParallelConfig` of the flags, validated for `world_size` GPUs."""
    from miles import parallel

    config = parallel.ParallelConfig(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        cp=args.context_parallel_size,
        ep=args.expert_model_parallel_size,
        etp=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        first_stage_layers=args.decoder_first_pipeline_num_layers,
        last_stage_layers=args.decoder_last_pipeline_num_layers,
    )
    parallel.validate(config, world_size, model_shape(args))
    return config


def model_shape(args):
    """The model facts the layout rules need: from the Megatron flags, else the HF config."""
    from miles import parallel

    hf = {}
    config_path = Path(args.hf_checkpoint) / "config.json"
    if config_path.is_file():
        hf = json.loads(config_path.read_text())
    heads = args.num_attention_heads or hf.get("num_attention_heads")
    return parallel.ModelShape(
        num_layers=args.num_layers or hf.get("num_hidden_layers"),
        num_attention_heads=heads,
        num_query_groups=args.num_query_groups or hf.get("num_key_value_heads") or heads,
        num_experts=args.num_experts or hf.get("num_experts") or hf.get("n_routed_experts"),
    )


class MegatronBackend(TrainBackend):
    def __init__(self, args, dist_info):
        world = args.actor_num_nodes * args.actor_num_gpus_per_node
        self.layout = parallel_layout(args, world)
        if dist_info.device == "cpu":
            raise BackendUnavailable(
                "--train-backend megatron needs CUDA or ROCm GPUs (megatron-core's model does not run "
                "on CPU); this machine has none. The parallel layout "
                f"{self.layout} is valid for {world} GPUs. On CPU use --train-backend fsdp or ddp."
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
