"""--sglang-* flags become SGLang server arguments of the right types (no GPU needed: the
server-argument class is passed in, here a stand-in dataclass with SGLang's field names)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from miles.train.args import parse_args
from miles.train.distributed import DistInfo
from miles.train.sglang_engine import SGLangUnavailable, server_kwargs


@dataclass
class ServerArgs:  # the shape of sglang.srt.server_args.ServerArgs for the fields used here
    model_path: str = ""
    tp_size: int = 1
    mem_fraction_static: float | None = None
    enable_dp_attention: bool = False
    dp_size: int = 1
    moe_a2a_backend: str = "none"
    cuda_graph_bs: list[int] | None = None
    chunked_prefill_size: int | None = None


RANK1 = DistInfo(rank=1, world_size=2, local_rank=1, device="cuda:1", backend="nccl")


def test_passthrough_values_take_the_server_argument_types():
    args = parse_args(
        "--hf-checkpoint /m --rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.6 "
        "--sglang-enable-dp-attention --sglang-dp-size 2 --sglang-moe-a2a-backend mori "
        "--sglang-cuda-graph-bs 1 2 4 --sglang-chunked-prefill-size 4096".split()
    )
    kwargs = server_kwargs(args, RANK1, ServerArgs)
    assert kwargs["model_path"] == "/m" and kwargs["tp_size"] == 2 and kwargs["base_gpu_id"] == 1
    assert kwargs["mem_fraction_static"] == 0.6 and kwargs["random_seed"] == args.rollout_seed + 1
    assert kwargs["enable_dp_attention"] is True and kwargs["dp_size"] == 2
    assert kwargs["moe_a2a_backend"] == "mori" and kwargs["cuda_graph_bs"] == [1, 2, 4]
    assert kwargs["chunked_prefill_size"] == 4096


def test_unknown_sglang_flag_is_named():
    args = parse_args(["--hf-checkpoint", "/m", "--sglang-no-such-knob", "1"])
    with pytest.raises(SGLangUnavailable, match="--sglang-no-such-knob: this SGLang has no server argument"):
        server_kwargs(args, RANK1, ServerArgs)
