"""Routing replay's pieces that need no training run: SGLang's routed-experts answer read back, what
the pinned sglang's own source accepts, the flags' refusals, and the samples' routing through
collate and the debug rollout files."""

from __future__ import annotations

import ast
import base64
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.train.args import ArgsError, parse_config
from miles.train.batch import Sample, collate, load_samples, save_samples
from miles.train.consumption import refusal
from miles.train.rollout import Generation
from miles.train.routing_replay import RoutingReplayError
from miles.train.sglang_engine import to_generation

register_cpu_ci(est_time=1, suite="stage-a-cpu")


def _sglang_source(relative: str) -> ast.Module:
    origin = Path(importlib.util.find_spec("sglang").origin).parent
    return ast.parse((origin / relative).read_text())


def test_the_pinned_sglang_takes_the_request_flag_and_the_server_argument_the_engine_sends():
    engine = _sglang_source("srt/entrypoints/engine.py")
    generate = next(
        f for node in ast.walk(engine) if isinstance(node, ast.ClassDef) and node.name == "Engine"
        for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "generate"
    )  # fmt: skip
    assert "return_routed_experts" in [a.arg for a in generate.args.args + generate.args.kwonlyargs]
    fields = _sglang_source("srt/arg_groups/fields/exec_.py")
    names = {
        n.target.id
        for n in ast.walk(fields)
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert "enable_return_routed_experts" in names


def test_sglangs_base64_routed_experts_become_the_generations_rows():
    routed = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2)  # prompt 3 + response 2 - 1 rows
    out = {
        "meta_info": {
            "finish_reason": {"type": "stop"},
            "output_token_logprobs": [(-0.5, 7, None), (-0.1, 9, None)],
            "routed_experts": base64.b64encode(routed.tobytes()).decode("ascii"),
        }
    }
    generation = to_generation([1, 2, 3], out, routed_layers=3)
    assert generation.routed_experts.tolist() == routed.tolist()
    assert to_generation([1, 2, 3], out).routed_experts is None


def _sample(routed) -> Sample:
    return Sample(
        0, 0, Generation((1, 2, 3), (4, 5), (-0.1, -0.2), "stop", routed_experts=routed), "", "", 1.0
    )


def test_collate_places_each_fed_tokens_experts_and_leaves_the_rest_unrecorded(tmp_path):
    routed = torch.tensor(
        [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]], dtype=torch.int32
    )  # 4 rows, 1 layer, top-2
    batch = collate([_sample(routed)])
    assert batch.routed_experts.shape == (1, 5, 1, 2)
    assert batch.routed_experts[0, :4].tolist() == routed.tolist()
    assert batch.routed_experts[0, 4].tolist() == [[-1, -1]]  # the last token is never fed
    save_samples(str(tmp_path / "r.json"), [_sample(routed)])
    assert load_samples(str(tmp_path / "r.json"))[0].generation.routed_experts.tolist() == routed.tolist()


def test_a_sample_whose_routing_misses_tokens_is_refused_naming_it():
    with pytest.raises(RoutingReplayError, match="sample 0 .*4 fed tokens"):
        collate([_sample(torch.zeros((2, 1, 2), dtype=torch.int32))])


def test_r2_is_refused_with_its_reason():
    config = parse_config(["--hf-checkpoint", "m", "--use-routing-replay"], raising=True)
    line = refusal(config, "torch")
    assert "--use-routing-replay" in line and "(R2)" in line


def test_r3_with_engines_in_processes_of_their_own_is_refused():
    with pytest.raises(ArgsError, match="--use-rollout-routing-replay with --rollout-num-gpus"):
        parse_config(
            ["--hf-checkpoint", "m", "--use-rollout-routing-replay", "--rollout-num-gpus", "2"], raising=True
        )
