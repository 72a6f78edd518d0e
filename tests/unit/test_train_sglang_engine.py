"""The SGLang rollout engine against the pinned sglang itself (requirements/cpu-sglang.txt).

Server arguments are checked against the real `ServerArgs` (a msgspec Struct in 0.5.23):
tests/unit/sglang_probe.py imports it in a process of its own and constructs it from what
miles builds. `sglang.Engine` starts GPU worker processes, and its module cannot be imported
without sglang's GPU stack (torchvision built for CUDA, triton), so its method signatures are
read from the installed engine.py's syntax tree, and the engine in these tests is a stand-in
whose methods have exactly those signatures: a call miles makes that the real Engine would
reject fails here too. The stand-in is the only thing not real, because it needs a GPU.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.train.args import SamplingConfig, parse_args
from miles.train.distributed import DistInfo
from miles.train.rollout import RolloutEngineError
from miles.train.sglang_engine import (
    SGLangRolloutEngine,
    SGLangUnavailable,
    engine_slot,
    to_generation,
)

REQUIRE = os.environ.get("MILES_REQUIRE_SGLANG") == "1"
SPEC = importlib.util.find_spec("sglang")
if SPEC is None:
    if REQUIRE:
        raise RuntimeError(
            "MILES_REQUIRE_SGLANG=1 but sglang is not installed: pip install --no-deps -r requirements/cpu-sglang.txt"
        )
    pytest.skip(
        "sglang is not installed: pip install --no-deps -r requirements/cpu-sglang.txt (nox -s tests does)",
        allow_module_level=True,
    )
SGLANG = Path(SPEC.origin).parent
PROBE = Path(__file__).with_name("sglang_probe.py")
ROOT = Path(__file__).resolve().parents[2]


def probe(cases: list[dict]) -> list[dict]:
    done = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(cases)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


CASES = {
    "passthrough": {
        "argv": (
            "--hf-checkpoint /m --sglang-mem-fraction-static 0.6 --sglang-dp-size 2 "
            "--sglang-moe-a2a-backend mori --sglang-chunked-prefill-size 4096 "
            "--sglang-cuda-graph-bs-decode 1 2 4 --sglang-enable-deterministic-inference"
        ).split(),
        "rank": 1, "local_rank": 1, "local_world": 2,
    },
    "one_value_of_a_list": {"argv": "--hf-checkpoint /m --sglang-cuda-graph-bs-decode 8".split()},
    "tp2_rank3": {
        "argv": "--hf-checkpoint /m --rollout-num-gpus-per-engine 2".split(),
        "rank": 3, "local_rank": 3, "local_world": 4,
    },
    "unknown": {"argv": "--hf-checkpoint /m --sglang-no-such-knob 1".split()},
    "bad_type": {"argv": "--hf-checkpoint /m --sglang-chunked-prefill-size lots".split()},
    "bad_choice": {"argv": "--hf-checkpoint /m --sglang-moe-a2a-backend carrier-pigeon".split()},
    "tp3_of_4": {"argv": "--hf-checkpoint /m --rollout-num-gpus-per-engine 3".split(), "local_world": 4},
}  # fmt: skip


@pytest.fixture(scope="module")
def answers() -> dict[str, dict]:
    return dict(zip(CASES, probe(list(CASES.values())), strict=True))


def test_server_args_is_the_msgspec_struct_miles_reads(answers):
    assert answers["passthrough"]["is_msgspec_struct"]


def test_passthrough_flags_build_a_real_server_args_of_the_declared_types(answers):
    built, types = answers["passthrough"]["built"], answers["passthrough"]["types"]
    assert built["model_path"] == "/m" and built["tp_size"] == 1 and built["base_gpu_id"] == 1
    assert built["mem_fraction_static"] == 0.6 and types["mem_fraction_static"] == "float"
    assert built["dp_size"] == 2 and types["dp_size"] == "int"
    assert built["moe_a2a_backend"] == "mori" and built["chunked_prefill_size"] == 4096
    assert built["cuda_graph_bs_decode"] == [1, 2, 4]
    assert built["enable_deterministic_inference"] is True


def test_colocated_engine_enables_the_memory_saver_and_seeds_the_server(answers):
    built = answers["passthrough"]["built"]
    assert built["enable_memory_saver"] is True
    assert built["random_seed"] == answers["passthrough"]["rollout_seed"] + 1


def test_a_single_value_for_a_list_argument_becomes_a_list(answers):
    assert answers["one_value_of_a_list"]["built"]["cuda_graph_bs_decode"] == [8]


def test_engines_of_two_gpus_start_on_their_own_first_gpu(answers):
    assert answers["tp2_rank3"]["built"]["base_gpu_id"] == 2 and answers["tp2_rank3"]["built"]["tp_size"] == 2


def test_unknown_sglang_flag_is_named(answers):
    assert (
        answers["unknown"]["error"]
        == "--sglang-no-such-knob: this SGLang has no server argument 'no_such_knob'"
    )


def test_a_value_of_the_wrong_type_names_the_declared_type(answers):
    assert answers["bad_type"]["error"].startswith("--sglang-chunked-prefill-size 'lots': SGLang declares")
    assert "int" in answers["bad_type"]["error"]


def test_a_value_outside_the_declared_choices_is_refused(answers):
    assert answers["bad_choice"]["error"].startswith("--sglang-moe-a2a-backend 'carrier-pigeon'")


def test_engine_size_that_does_not_divide_the_node_is_refused(answers):
    assert (
        "--rollout-num-gpus-per-engine 3 does not divide the 4 GPUs per node" in answers["tp3_of_4"]["error"]
    )


def test_engines_tile_the_gpus_without_overlap():
    for local_world, per_engine in ((8, 1), (8, 2), (8, 4), (4, 4)):
        slots = [engine_slot(r, r, local_world, per_engine) for r in range(local_world)]
        leaders = [s for s in slots if s.leader]
        spans = [set(range(s.base_gpu_id, s.base_gpu_id + per_engine)) for s in leaders]
        assert len(leaders) == local_world // per_engine
        assert set().union(*spans) == set(range(local_world)) and sum(map(len, spans)) == local_world
        for rank, slot in enumerate(slots):
            assert rank in slot.group and slots[slot.group[0]].leader


# --- the Engine's methods, read from the installed sglang's source ---


def engine_signatures() -> dict[str, inspect.Signature]:
    tree = ast.parse((SGLANG / "srt/entrypoints/engine.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    return {f.name: _signature(f) for f in cls.body if isinstance(f, ast.FunctionDef)}


def _signature(fn: ast.FunctionDef) -> inspect.Signature:
    a, P = fn.args, inspect.Parameter
    params = []
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        kind = P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=P.empty if default is None else ...))
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=P.empty if default is None else ...))
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params[1:])  # without self


SIGNATURES = engine_signatures()


class StandInEngine:
    """sglang.Engine without its GPU worker processes: each method binds its arguments to the
    installed Engine's signature, records the call and answers as sglang 0.5.23 does."""

    def __init__(self, **kwargs):
        SIGNATURES["__init__"].bind(**kwargs)
        self.kwargs, self.calls = kwargs, []
        self.update_result = (True, "Succeeded to update model weights.")
        self.finish = {"type": "length", "length": 3}

    def _record(self, name, *args, **kwargs):
        SIGNATURES[name].bind(*args, **kwargs)
        self.calls.append((name, kwargs))

    def generate(self, *args, **kwargs):
        self._record("generate", *args, **kwargs)
        return [
            {
                "text": "",
                "meta_info": {
                    "finish_reason": self.finish,
                    "output_token_logprobs": [(-0.5, 7, None), (-1.25, 8, None), (-0.125, 2, None)],
                },
            }  # fmt: skip
            for _ in kwargs["input_ids"]
        ]

    def update_weights_from_tensor(self, *args, **kwargs):
        self._record("update_weights_from_tensor", *args, **kwargs)
        return self.update_result

    def release_memory_occupation(self, *args, **kwargs):
        self._record("release_memory_occupation", *args, **kwargs)

    def resume_memory_occupation(self, *args, **kwargs):
        self._record("resume_memory_occupation", *args, **kwargs)

    def shutdown(self, *args, **kwargs):
        self._record("shutdown", *args, **kwargs)


def make_engine(extra: str = "", **dist) -> SGLangRolloutEngine:
    """The adapter over the stand-in Engine. Its ServerArgs is a msgspec Struct with the real
    one's names for the fields miles sets (the real class is checked in the probe above)."""
    import msgspec

    fields = {"model_path": (str, ...), "tp_size": (int, 1), "random_seed": (int, 0), "log_level": (str, ""),
              "enable_memory_saver": (bool, False), "base_gpu_id": (int, 0),
              "enable_deterministic_inference": (bool, False)}  # fmt: skip
    server_args = msgspec.defstruct(
        "ServerArgs", [(k, t) if d is ... else (k, t, d) for k, (t, d) in fields.items()]
    )
    args = parse_args(["--hf-checkpoint", "/m", *extra.split()])
    info = DistInfo(
        **({"rank": 0, "world_size": 1, "local_rank": 0, "device": "cuda:0", "backend": "nccl"} | dist)
    )
    return SGLangRolloutEngine(args, info, engine_cls=StandInEngine, server_args_cls=server_args)


SAMPLING = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_response_len=3, stop_token_ids=(2,))


def test_the_methods_miles_calls_exist_on_the_installed_engine():
    for name in ("generate", "update_weights_from_tensor", "release_memory_occupation",
                 "resume_memory_occupation", "shutdown"):  # fmt: skip
        assert name in SIGNATURES, f"sglang.Engine has no {name} in {SGLANG}"


def test_update_weights_from_tensor_answers_success_and_message():
    source = (SGLANG / "srt/managers/tokenizer_control_mixin.py").read_text()
    tree = ast.parse(source)
    (fn,) = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.AsyncFunctionDef) and n.name == "update_weights_from_tensor"
    ]
    assert ast.unparse(fn.returns) == "Tuple[bool, str]"


def test_generate_sends_token_ids_and_sampling_params_the_engine_accepts():
    engine = make_engine()
    gens = engine.generate([[5, 6], [7]], SAMPLING, seed=11)
    name, kwargs = engine.engine.calls[-1]
    assert name == "generate" and kwargs["input_ids"] == [[5, 6], [7]] and kwargs["return_logprob"] is True
    assert kwargs["sampling_params"]["no_stop_trim"] is True and kwargs["sampling_params"]["top_k"] == 20
    assert [g.response_ids for g in gens] == [(7, 8, 2)] * 2 and gens[0].logprobs == (-0.5, -1.25, -0.125)


def test_the_seed_is_sent_only_where_sglang_honours_it():
    plain = make_engine()
    plain.generate([[5]], SAMPLING, seed=11)
    assert "sampling_seed" not in plain.engine.calls[-1][1]["sampling_params"]
    deterministic = make_engine("--sglang-enable-deterministic-inference")
    deterministic.generate([[5]], SAMPLING, seed=11)
    assert deterministic.engine.calls[-1][1]["sampling_params"]["sampling_seed"] == 11


def test_sglang_samples_with_the_seed_only_in_deterministic_inference():
    # The fact the previous test relies on, read from the installed sglang.
    source = (SGLANG / "srt/sampling/sampling_batch_info.py").read_text()
    assert "if enable_deterministic\n            else None" in source


def test_a_refused_weight_update_is_an_error_with_sglangs_message():
    engine = make_engine()
    engine.engine.update_result = (False, "Failed to update weights: shape mismatch for lm_head.weight")
    with pytest.raises(
        RolloutEngineError, match="refused the weight update: Failed to update weights: shape"
    ):
        engine.update_weights([("lm_head.weight", object())])


def test_weights_go_to_sglang_in_buckets_and_the_cache_is_flushed_once_at_the_end():
    import torch

    engine = make_engine("--update-weight-buffer-size 1000")
    tensors = [(f"w{i}", torch.zeros(100)) for i in range(7)]  # 400 bytes each
    engine.update_weights(iter(tensors))
    pushes = [c for c in engine.engine.calls if c[0] == "update_weights_from_tensor"]
    assert [[n for n, _ in c[1]["named_tensors"]] for c in pushes] == [
        ["w0", "w1", "w2"], ["w3", "w4", "w5"], ["w6"],
    ]  # fmt: skip
    assert [c[1]["flush_cache"] for c in pushes] == [False, False, True]


def test_memory_is_released_for_training_and_resumed_before_weights_and_sampling():
    engine = make_engine()
    engine.release_memory()
    engine.release_memory()  # twice is once
    engine.update_weights([("w", object())])
    engine.release_memory()
    engine.generate([[5]], SAMPLING, seed=0)
    assert [c[0] for c in engine.engine.calls] == [
        "release_memory_occupation", "resume_memory_occupation", "update_weights_from_tensor",
        "release_memory_occupation", "resume_memory_occupation", "generate",
    ]  # fmt: skip


def test_finish_reasons_sglang_reports_are_the_ones_miles_maps():
    tree = ast.parse((SGLANG / "srt/managers/schedule_batch.py").read_text())
    kinds = {
        node.values[node.keys.index(key)].value
        for node in ast.walk(tree) if isinstance(node, ast.Dict)
        for key in node.keys if isinstance(key, ast.Constant) and key.value == "type"
        if isinstance(node.values[node.keys.index(key)], ast.Constant)
    }  # fmt: skip
    assert {"stop", "length", "abort"} <= kinds


def test_an_aborted_request_is_not_a_normal_stop():
    out = {"meta_info": {"finish_reason": {"type": "abort", "message": "input is longer than the context"},
                         "output_token_logprobs": []}}  # fmt: skip
    with pytest.raises(RolloutEngineError, match="did not finish a request \\(abort: input is longer"):
        to_generation([1, 2, 3], out)
    engine = make_engine()
    engine.engine.finish = {"type": "abort", "message": "cancelled"}
    with pytest.raises(RolloutEngineError, match="abort: cancelled"):
        engine.generate([[5]], SAMPLING, seed=0)


def test_length_and_stop_finishes_map_to_the_generation():
    stop = to_generation([1], {"meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                                             "output_token_logprobs": [(-0.1, 2, None)]}})  # fmt: skip
    assert stop.finish_reason == "stop" and stop.response_ids == (2,)


def test_only_the_first_rank_of_an_engine_group_starts_an_engine():
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        leader = make_engine("--rollout-num-gpus-per-engine 2", rank=0, local_rank=0, world_size=2)
        member = make_engine("--rollout-num-gpus-per-engine 2", rank=1, local_rank=1, world_size=2)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    assert leader.engine is not None and leader.engine.kwargs["base_gpu_id"] == 0
    assert member.engine is None and member.slot.group == (0, 1)
    member.update_weights(iter([("w", object())]))  # a member pushes nothing, and fails nothing


def test_the_weight_check_cannot_read_sglang_weights_and_says_why():
    engine = make_engine()
    assert engine.exact_weights is False
    with pytest.raises(NotImplementedError, match="get_weights_by_name"):
        next(engine.named_weights())


def test_on_cpu_the_engine_names_the_alternative():
    args = parse_args(["--hf-checkpoint", "/m"])
    cpu = DistInfo(rank=0, world_size=1, local_rank=0, device="cpu", backend="gloo")
    with pytest.raises(SGLangUnavailable, match="use --rollout-engine torch"):
        SGLangRolloutEngine(args, cpu)
