"""The SGLang rollout engine against the pinned sglang's own code (requirements/cpu-sglang.txt).

Server arguments are checked against the real `ServerArgs` (a msgspec Struct in 0.5.23):
one is constructed from what miles builds. Everything else runs the adapter against a real
`sglang.Engine` whose scheduler lives in the scenarios' process (tests/unit/sglang_scenarios.py
over tests/unit/sglang_local.py): sglang's own Engine
methods, tokenizer-manager control plane, request validation, SamplingParams, finish
reasons, weight-update session, tagged memory release, flattened-bucket deserialization and
subprocess watchdog. What stands in is what needs a GPU (the model and its sampler, the
memory saver) or is a process boundary (the zmq sockets); sglang_local.py's docstring lists
each with the sglang file whose rule it follows.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.train.args import parse_config
from miles.train.config import SamplingConfig
from miles.train.distributed import DistInfo
from miles.train.rollout import RolloutEngineError
from miles.train.sglang_engine import SGLangRolloutEngine, sampling_params, to_generation
from miles.train.sglang_server import SGLangUnavailable, engine_slot, require_memory_saver

register_cpu_ci(est_time=25, suite="stage-a-cpu")

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
SCENARIOS = Path(__file__).with_name("sglang_scenarios.py")
ROOT = Path(__file__).resolve().parents[2]
from tests.unit.sglang_imports import missing_requirements  # noqa: E402

MISSING = missing_requirements()
if MISSING:
    if REQUIRE:
        raise RuntimeError(
            f"MILES_REQUIRE_SGLANG=1 but {MISSING} are not installed: requirements/cpu-sglang.txt"
        )
    pytest.skip(
        f"{', '.join(MISSING)} not installed: pip install --no-deps -r requirements/cpu-sglang.txt",
        allow_module_level=True,
    )


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


def scenarios(tmp_path_factory, *names: str) -> dict:
    """sglang_scenarios.py's findings for `names`, run in a process of their own."""
    workdir = tmp_path_factory.mktemp("sglang")
    (workdir / "server_args.json").write_text(json.dumps(list(CASES.values())))
    done = subprocess.run(
        [sys.executable, str(SCENARIOS), str(workdir), *names], capture_output=True, text=True, timeout=600,
        cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    """One process: the server arguments, the single-engine scenarios, and last the dead engine."""
    return scenarios(tmp_path_factory, "server-args", "session", "fp8", "oversized", "probe-sampling", "died")


@pytest.fixture(scope="module")
def answers(found) -> dict[str, dict]:
    return dict(zip(CASES, found["server-args"], strict=True))


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


def test_the_launch_sigquit_handler_travels_into_the_engine_processes(answers):
    # sglang pickles ServerArgs into its scheduler processes; a closure would not pickle
    assert answers["passthrough"]["pickles"] is True


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


# --- the adapter against sglang's Engine, tokenizer manager and scheduler (sglang_local.py) ---


def requests(log: list) -> list[str]:
    return [e[0] for e in log if e[0].endswith("ReqInput")]


def test_colocate_makes_the_engine_release_its_memory_while_the_trainer_steps(found):
    """The trainer releases a colocated engine's memory before its step (miles.train.trainer.learn);
    without --colocate or --offload-rollout the engine keeps it."""
    assert found["session"]["colocated"] is True  # built with --colocate
    assert found["oversized"]["colocated"] is False  # built without


def test_sglang_refuses_a_weight_update_outside_a_session(found):
    # sglang's SchedulerWeightUpdaterManager.update_weights_from_tensor, through the real Engine
    assert found["session"]["outside_session"] == [
        False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
    ]  # fmt: skip


def test_a_weight_push_is_one_session_with_generation_paused_and_the_cache_flushed(found):
    asked = requests(found["session"]["log"])
    start = asked.index("PauseGenerationReqInput")
    pushes = asked.count("UpdateWeightsFromTensorReqInput")
    assert asked[start : start + 3 + pushes + 2] == [
        "PauseGenerationReqInput", "FlushCacheReqInput", "BeginWeightUpdateReqInput",
        *["UpdateWeightsFromTensorReqInput"] * pushes, "EndWeightUpdateReqInput", "ContinueGenerationReqInput",
    ]  # fmt: skip


def test_every_tensor_reaches_the_engine_in_flattened_buckets(found):
    session = found["session"]
    assert session["all_pushed"] and session["loaded"] == session["tensors"]
    assert (
        requests(session["log"]).count("UpdateWeightsFromTensorReqInput") > 1
    )  # --update-weight-buffer-size


def test_memory_is_released_by_tag_and_the_kv_cache_returns_after_the_push_and_a_clear(found):
    events = [
        e
        for e in found["session"]["log"]
        if e[0] in ("pause", "resume", "clear_memory", "EndWeightUpdateReqInput")
    ]
    assert events == [
        ["pause", "kv_cache"], ["pause", "weights"], ["pause", "cuda_graph"],  # released once, for training
        ["clear_memory"], ["resume", "weights"], ["EndWeightUpdateReqInput"],
        ["clear_memory"], ["resume", "cuda_graph"], ["resume", "kv_cache"],
    ]  # fmt: skip


def test_rollouts_come_back_in_sglangs_formats(found):
    # finish_reason from FINISH_LENGTH.to_json, logprobs as TokenizerManager.detokenize_logprob_tokens lays them out
    assert found["session"]["generations"] == [["length", 4, 4], ["length", 4, 4]]


def test_an_engine_serving_an_fp8_checkpoint_gets_its_fp8_weights_bit_for_bit(found):
    assert found["fp8"]["fp8_tensors"] > 0 and found["fp8"]["differing"] == []


def test_a_prompt_over_the_context_length_is_one_line_naming_the_limit(found):
    error = found["oversized"]["error"]
    assert error.startswith(
        "SGLang refused the rollout requests: The input (4096 tokens) is longer than the model's context length "
        "(4096 tokens). (prompts of 4096-4096 tokens"
    )
    assert "--sglang-context-length" in error and "\n" not in error


def test_the_weight_probe_is_greedy_at_temperature_one_for_sglang(found):
    assert found["probe-sampling"]["probe"] == {"temperature": 1.0, "top_k": 1}
    assert found["probe-sampling"]["rollout"] == {"temperature": 0.8, "top_k": 20}


def test_a_dead_engine_process_fails_the_call_in_one_line_and_the_trainer_lives(found):
    # sglang's own SIGQUIT reaction SIGKILLs this process tree: the scenarios would exit -9
    died = found["died"]
    assert died["error"].startswith("the SGLang engine lost scheduler_TP0 (pid ")
    assert "exit code -9) during generate" in died["error"] and died["seconds"] < 30


def test_each_engine_rank_loads_its_own_ranks_payload_and_followers_wait_over_gloo(tmp_path_factory):
    group = scenarios(tmp_path_factory, "group")["group"]
    assert group["follower_rc"] == 0
    assert group["leader"]["tp_rank_values"] == [[1.0], [2.0]]  # rank r pushed r + 1
    assert group["leader"]["prompts_back"] == [[5, 6]] and group["follower"]["prompts_back"] == [
        [7, 8, 9],
        [10],
    ]
    assert group["leader"]["group_backend"] == group["follower"]["group_backend"] == "gloo"


SAMPLING = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_response_len=3, stop_token_ids=(2,))


def test_the_seed_is_sent_only_where_sglang_honours_it():
    assert "sampling_seed" not in sampling_params(SAMPLING, None)
    assert sampling_params(SAMPLING, 11)["sampling_seed"] == 11


def test_sglang_samples_with_the_seed_only_in_deterministic_inference():
    # The fact seeds_honoured relies on, read from the installed sglang.
    source = (SGLANG / "srt/sampling/sampling_batch_info.py").read_text()
    assert "if enable_deterministic\n            else None" in source


def test_an_aborted_request_is_not_a_normal_stop():
    out = {
        "meta_info": {"finish_reason": {"type": "abort", "message": "cancelled"}, "output_token_logprobs": []}
    }
    with pytest.raises(RolloutEngineError, match="did not finish a request \\(abort: cancelled"):
        to_generation([1, 2, 3], out)


def test_a_stop_finish_keeps_the_stop_token():
    stop = to_generation([1], {"meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                                             "output_token_logprobs": [(-0.1, 2, None)]}})  # fmt: skip
    assert stop.finish_reason == "stop" and stop.response_ids == (2,)


def test_on_cpu_the_engine_names_the_alternative():
    config = parse_config(["--hf-checkpoint", "/m"])
    cpu = DistInfo(rank=0, world_size=1, local_rank=0, device="cpu", backend="gloo")
    with pytest.raises(SGLangUnavailable, match="use --rollout-engine torch"):
        SGLangRolloutEngine(
            sglang=config.sglang,
            checkpoint=config.checkpoint,
            rollout=config.rollout,
            job=config.job,
            dist_info=cpu,
        )


def test_a_missing_memory_saver_is_named_before_the_engine_starts():
    if importlib.util.find_spec("torch_memory_saver") is not None:
        pytest.skip("torch-memory-saver is installed here")
    with pytest.raises(SGLangUnavailable, match="torch-memory-saver is not installed"):
        require_memory_saver()
