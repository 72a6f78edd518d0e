"""The built-in engine as a process of its own (miles.train.remote.server), driven the way the
trainer drives it: the engine process is real (started by the fleet's launcher), and this test
process is trainer rank 0. Every weight transfer mode leaves the engine's tensors equal to the
trainer's bit for bit (its checksums of their bytes); a pause in each of its modes does what
SGLang's does to the requests in flight, and the outputs say which weight version made which
tokens. No assertion depends on timing: the test waits for what the server reports.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.train.config import SamplingConfig
from miles.train.remote.checksums import tensor_checksum
from miles.train.remote.client import EngineClient
from miles.train.remote.disk import Publisher
from miles.train.remote.fleet import Engine, Fleet, spawn, torch_server_args, wait_for_file
from miles.train.remote.transfer import BroadcastTransfer, DiskTransfer
from miles.train.rollout import RolloutEngineError, TorchRolloutEngine

register_cpu_ci(est_time=6, suite="stage-b-cpu")

SAMPLING = SamplingConfig(temperature=1.0, top_p=1.0, top_k=-1, max_response_len=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from miles.ckpt.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("qwen3", 2, tmp_path_factory.mktemp("ckpt") / "qwen3", progress=False)


@pytest.fixture(scope="module")
def fleet(tiny, tmp_path_factory):
    logs = tmp_path_factory.mktemp("engine")
    ready, log = logs / "engine-0.url", logs / "engine-0.log"
    process = spawn(
        "miles.train.remote.server", torch_server_args("engine-0", str(tiny), "float32", ready), log
    )
    url = wait_for_file(ready, process, "engine-0", log)
    fleet = Fleet(
        [Engine("engine-0", "default", True, True, EngineClient(url, "engine-0"), process=process, log=log)]
    )
    yield fleet
    fleet.close()


@pytest.fixture(scope="module")
def trainer_model(tiny):
    from miles.train.model import load_causal_lm

    return load_causal_lm(tiny, dtype=torch.float32)


def _moved(model, seed: int) -> dict[str, torch.Tensor]:
    """The model's tensors, each moved by a seeded step (what a training step would change)."""
    g = torch.Generator().manual_seed(seed)
    moved: dict[int, torch.Tensor] = {}  # tied tensors (embedding and head) move together
    return {
        n: moved.setdefault(t.data_ptr(), t.detach() + 1e-2 * torch.randn(t.shape, generator=g))
        for n, t in model.state_dict().items()
    }


def _engine_checksums(fleet: Fleet) -> dict[str, str]:
    return fleet.engines[0].client.post("/weights_checker", {"action": "checksum"})["ranks"][0]["checksums"]


def _assert_holds(fleet: Fleet, weights: dict[str, torch.Tensor]) -> None:
    held = _engine_checksums(fleet)
    assert held == {n: tensor_checksum(t) for n, t in weights.items()}


def _push(fleet: Fleet, transfer, weights: dict[str, torch.Tensor], version: int) -> None:
    transfer.push(fleet, fleet.engines, iter(weights.items()), version)


def test_the_engine_process_samples_what_the_in_process_engine_samples(fleet, trainer_model, tmp_path):
    weights = _moved(trainer_model, 1)
    _push(fleet, DiskTransfer(Publisher(tmp_path)), weights, 1)
    local = TorchRolloutEngine(_loaded(trainer_model, weights))
    prompts = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8]]
    # with the engine process's one thread (its --num-threads default): a matmul split over two
    # threads sums in another order, and the logprobs then differ in their last bits (4.8e-7 seen)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        here = local.generate(prompts, SAMPLING, seed=11)
    finally:
        torch.set_num_threads(threads)
    there = fleet.engines[0].client.generate(prompts, SAMPLING, seed=11)
    assert [o.generation for o in there] == here
    assert {o.versions for o in there} == {(1,)}


def _loaded(model, weights):
    import copy

    clone = copy.deepcopy(model)
    clone.load_state_dict(weights)
    return clone


def test_a_broadcast_leaves_the_engine_bit_equal_to_the_trainer(fleet, trainer_model):
    transfer = BroadcastTransfer(backend="gloo", address="127.0.0.1", bucket_bytes=64 << 10)
    try:
        for version, seed in ((2, 2), (3, 3)):  # the second sync reuses the group
            weights = _moved(trainer_model, seed)
            _push(fleet, transfer, weights, version)
            _assert_holds(fleet, weights)
            assert fleet.engines[0].client.get("/get_server_info")["weight_version"] == str(version)
    finally:
        transfer.close()


def test_a_full_disk_version_leaves_the_engine_bit_equal_to_the_trainer(fleet, trainer_model, tmp_path):
    weights = _moved(trainer_model, 4)
    _push(fleet, DiskTransfer(Publisher(tmp_path / "pub")), weights, 4)
    _assert_holds(fleet, weights)


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_disk_deltas_leave_the_engine_bit_equal_to_the_trainer(fleet, trainer_model, tmp_path, encoding):
    transfer = DiskTransfer(
        Publisher(tmp_path / "pub", delta=True, encoding=encoding), str(tmp_path / "local")
    )
    weights = _moved(trainer_model, 5)
    _push(fleet, transfer, weights, 5)  # the first version is full: it seeds the host's copy
    _assert_holds(fleet, weights)
    changed = dict(weights)
    changed["model.norm.weight"] = weights["model.norm.weight"] * 2
    _push(fleet, transfer, changed, 6)
    manifest = json.loads((tmp_path / "pub" / "v00000006" / "manifest.json").read_text())
    assert (manifest["kind"], list(manifest["tensors"])) == ("delta", ["model.norm.weight"])
    _assert_holds(fleet, changed)


def test_a_broadcast_outside_a_weight_update_session_is_refused_as_sglang_does(fleet):
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]], "group_name": "none"}
    with pytest.raises(
        RolloutEngineError, match=r"must run between begin_weight_update\(\) and end_weight_update"
    ):
        fleet.engines[0].client.post("/update_weights_from_distributed", body)


# --- pauses across a weight update ---


def _generating(fleet: Fleet, tokens: int) -> Future:
    """A request of `tokens` tokens (no stop token) in flight; returns once it decodes."""
    client = fleet.engines[0].client
    before = client.get("/get_server_info")["decode_steps"]
    future: Future = Future()
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, top_k=-1, max_response_len=tokens)

    def run():
        try:
            future.set_result(client.generate([[5, 6, 7, 8]], sampling, seed=3)[0])
        except Exception as exc:
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    _wait_until(fleet, lambda info: info["decode_steps"] > before + 2)
    return future


def _wait_until(fleet: Fleet, condition, *, limit: float = 120.0) -> dict:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        info = fleet.engines[0].client.get("/get_server_info")
        if condition(info):
            return info
        time.sleep(0.01)
    raise AssertionError(f"the engine never reached the state waited for: {info}")


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_paused_request_continues_with_the_new_weights_and_says_which_tokens_each_made(
    fleet, trainer_model, tmp_path, mode
):
    client = fleet.engines[0].client
    _push(fleet, DiskTransfer(Publisher(tmp_path / "a")), _moved(trainer_model, 7), 7)
    pending = _generating(fleet, tokens=3000)
    client.post("/pause_generation", {"mode": mode})
    _wait_until(fleet, lambda info: info["held_requests"] == 1)
    new = _moved(trainer_model, 8)
    _push(fleet, DiskTransfer(Publisher(tmp_path / "b")), new, 8)
    steps = client.get("/get_server_info")["decode_steps"]
    client.post("/continue_generation")
    _wait_until(fleet, lambda info: info["decode_steps"] > steps + 2)
    client.post("/abort_request", {"abort_all": True})
    out = pending.result(timeout=120)
    assert out.generation.finish_reason == "abort" and out.versions == (7, 8)
    if mode == "retract":
        # the retracted request was recomputed from its prompt and tokens with the new weights:
        # its tokens after the update score under them as a full forward scores them
        from miles.train.batch import Sample, collate

        batch = collate([Sample(0, 0, out.generation, "", "", 0.0)])
        model = _loaded(trainer_model, new)
        with torch.no_grad():
            logits = (
                model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
            )
        full = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        (old, _, made), (later, start, _) = out.spans
        assert (old, later, start) == (7, 8, made)
        first_new = 4 - 1 + made  # the target position of the first token version 8 made
        engine = batch.rollout_logp[0, first_new : first_new + 3]
        assert torch.allclose(engine, full[0, first_new : first_new + 3], atol=1e-4)


def test_an_abort_pause_ends_the_request_in_flight(fleet, trainer_model, tmp_path):
    _push(fleet, DiskTransfer(Publisher(tmp_path)), _moved(trainer_model, 9), 9)
    pending = _generating(fleet, tokens=3000)
    fleet.engines[0].client.post("/pause_generation", {"mode": "abort"})
    out = pending.result(timeout=120)
    fleet.engines[0].client.post("/continue_generation")
    assert out.generation.finish_reason == "abort" and 0 < len(out.generation.response_ids) < 3000


# --- sessions and chat (the CPU twins of the seed's tests/e2e/sglang session and chat tests) ---


def test_a_multi_role_session_keeps_its_prefix_and_its_ids_are_the_trainers(
    fleet, trainer_model, tiny, tmp_path
):
    from miles.train.model import eos_token_ids, load_tokenizer
    from miles.train.remote import session_verify

    weights = _moved(trainer_model, 10)
    _push(fleet, DiskTransfer(Publisher(tmp_path)), weights, 10)
    tokenizer = load_tokenizer(tiny)
    sampling = SamplingConfig(1.0, 1.0, -1, 12, eos_token_ids(str(tiny), tokenizer))
    conv = session_verify.converse(
        fleet.engines[0].client, tokenizer, sampling, seed=4, cycles=2, builtin=True
    )
    session_verify.score(_loaded(trainer_model, weights), conv)
    roles = [m["role"] for m in conv.messages]
    assert {"system", "user", "tool", "assistant"} <= set(roles) and roles.count("assistant") == 6
    first, *later = conv.checks
    assert (first.cached_tokens, first.prefilled) == (0, first.prompt_tokens)
    for check in conv.checks:
        assert check.prompt_tokens == check.expected_tokens  # the engine's context is the trainer's ids
        assert check.logprob_gap < 1e-4  # ... token for token: its logprobs are the model's over them
    for check in later:
        assert check.cached_tokens == check.expected_cached > 0  # the previous turn's context, reused
        assert check.prefilled == check.prompt_tokens - check.cached_tokens  # only the new tokens
    assert session_verify.metrics([conv])["rollout/session_prefix_miss_rate"] == 0.0


def test_a_weight_load_drops_a_sessions_kept_prefix(fleet, trainer_model, tiny, tmp_path):
    from miles.train.model import load_tokenizer
    from miles.train.remote.client import sampling_params

    client = fleet.engines[0].client
    session = client.post("/open_session", {"capacity_of_str_len": 1024})
    ids = load_tokenizer(tiny).apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    params = sampling_params(SAMPLING, 1)
    first = client.post("/generate", {"input_ids": ids, "sampling_params": params, "rid": "a",
                                      "session_params": {"id": session}})  # fmt: skip
    _push(fleet, DiskTransfer(Publisher(tmp_path)), _moved(trainer_model, 11), 11)
    second = client.post("/generate", {"input_ids": [5, 6], "sampling_params": params, "rid": "b",
                                       "session_params": {"id": session, "rid": "a"}})  # fmt: skip
    client.post("/close_session", {"session_id": session})
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == 0  # recomputed with the new weights
    assert second["meta_info"]["prompt_tokens"] == len(ids) + len(first["output_ids"]) + 2


def test_chat_completions_and_generate_agree_on_the_trainers_template_ids(fleet, tiny):
    """The seed's test_chat_input_ids_equivalence against the built-in engine: the engine's chat
    template gives the trainer's prompt ids, and both endpoints produce the same completion (text,
    token ids, logprobs within 1e-6) at temperature 0."""
    from miles.train.data import Prompt, encode_prompt
    from miles.train.model import load_tokenizer

    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Answer with one word: 2+2?"},
    ]
    trainer_ids = encode_prompt(
        Prompt(0, tuple(messages), "", {}), load_tokenizer(tiny), apply_chat_template=True, system_prompt=None
    )
    client = fleet.engines[0].client
    generated = client.post(
        "/generate",
        {"input_ids": trainer_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 20, "sampling_seed": 1234},
         "return_logprob": True},
    )  # fmt: skip
    chat = client.post(
        "/v1/chat/completions",
        {"model": "m", "messages": messages, "temperature": 0, "max_completion_tokens": 20, "seed": 1234,
         "logprobs": True, "return_prompt_token_ids": True},
    )["choices"][0]  # fmt: skip
    assert chat["prompt_token_ids"] == trainer_ids
    assert chat["message"]["content"] == generated["text"]
    chat_logprobs = [t["logprob"] for t in chat["logprobs"]["content"]]
    engine_logprobs = [lp for lp, _, _ in generated["meta_info"]["output_token_logprobs"]]
    assert len(chat_logprobs) == len(engine_logprobs) == len(generated["output_ids"])
    assert chat_logprobs == pytest.approx(engine_logprobs, abs=1e-6)
