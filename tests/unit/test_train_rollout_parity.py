"""The built-in rollout engine's per-token logprobs equal one full forward of the same sequences,
for every recipe family, in float32, under the installed transformers.

The engine decodes token by token against its KV cache, shares a GRPO group's prefill,
left-pads distinct prompts into one batch and drops finished rows; a full forward of each
sequence on its own does none of that. Agreement within 1e-5 means the cache, the padding
and the row selection are exact for that family and transformers version. transformers
renamed the forward's cache argument between the pinned versions (`past_key_values` in
5.19, `cache` in 5.24), and a name the forward does not declare is swallowed by its
**kwargs: decoding then runs without its context and these tests fail by whole nats.
`nox -s rollout-transformers` runs this file under each GPU lane's pinned transformers.
"""

from __future__ import annotations

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.families import family, names
from miles.train.config import SamplingConfig
from miles.train.rollout import RolloutEngineError, TorchRolloutEngine, cache_keyword

# measured: 54 s of CPU before GLM-4.7-Flash and Qwen3.5 joined the families it compares (199 s
# of wall at load 10); the implicit 15 s would time out on a quiet lane
register_cpu_ci(est_time=5, suite="stage-a-cpu")

# every family at its own tiny depth: DeepSeek-V4's compressed layers and Qwen3.5's first
# full-attention layer are its third and fourth
FAMILIES = names()
TOLERANCE = 1e-5  # float32: cache vs full forward differ only by summation order
# Distinct lengths (left padding), a GRPO group of 4 sharing its prefill, a one-token prompt.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40] * 1, [70, 71, 72]] + [[100, 101, 102, 103]] * 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from miles.train.model import load_causal_lm
    from tests.support.ckpt import tiny_hf

    built = {}
    for name in FAMILIES:
        path = tiny_hf(name, family(name).tiny_layers, dtype="float32")
        built[name] = load_causal_lm(path, dtype=torch.float32)
    return built


def full_forward_logprobs(model, prompt, response, temperature: float) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
    return logp[positions, torch.tensor(response)]


def max_gap(model, generations, temperature: float) -> float:
    gaps = [
        (torch.tensor(g.logprobs) - full_forward_logprobs(model, g.prompt_ids, g.response_ids, temperature))
        .abs()
        .max()
        .item()
        for g in generations
    ]
    return max(gaps)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_logprobs_equal_a_full_forward(models, family):
    model = models[family]
    engine = TorchRolloutEngine(model)
    sampling = SamplingConfig(temperature=0.9, top_p=1.0, top_k=-1, max_response_len=8)
    generations = engine.generate(PROMPTS, sampling, seed=7)
    assert all(len(g.response_ids) == 8 for g in generations)
    assert max_gap(model, generations, 0.9) <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_that_stop_early_leave_the_batch_without_disturbing_the_rest(models, family):
    model = models[family]
    engine = TorchRolloutEngine(model)
    free = engine.generate(PROMPTS, SamplingConfig(1.0, 1.0, -1, 8), seed=3)
    # Stop on a token some (not all) rows sample early, so the batch shrinks mid-decode.
    stop = free[0].response_ids[1]
    sampling = SamplingConfig(1.0, 1.0, -1, 8, stop_token_ids=(stop,))
    generations = engine.generate(PROMPTS, sampling, seed=3)
    assert any(g.finish_reason == "stop" for g in generations)
    assert max_gap(model, generations, 1.0) <= TOLERANCE


def test_the_cache_keyword_is_the_one_the_installed_forward_declares(models):
    import inspect

    model = models["qwen3"]
    name = cache_keyword(model)
    assert name in inspect.signature(model.forward).parameters


def test_a_cache_the_forward_ignores_is_refused_not_decoded_blind(models):
    # What happened when the engine passed `cache=` to transformers 5.19's forward: the
    # keyword fell into **kwargs, the cache stayed empty and decoding lost the prompt.
    engine = TorchRolloutEngine(models["qwen3"])
    engine.cache_keyword = "kv_cache_the_forward_does_not_declare"
    with pytest.raises(RolloutEngineError, match="holding 0 of 7 prompt positions"):
        engine.generate(PROMPTS, SamplingConfig(1.0, 1.0, -1, 4), seed=0)


def test_a_forward_with_no_cache_argument_is_refused_by_name():
    class NoCache(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return input_ids

    with pytest.raises(
        RolloutEngineError, match=r"NoCache.forward \(transformers .*\) declares none of cache"
    ):
        TorchRolloutEngine(NoCache())


def test_deepseek_v4_batches_by_prompt_length_only_once_a_compressed_layer_is_in_the_model():
    from miles.families.deepseek_v4 import CSA, HCA, SLIDING

    dsv4 = family("deepseek_v4")
    assert dsv4.left_padding_exact({"layer_types": [SLIDING, SLIDING, CSA], "num_hidden_layers": 2})
    assert not dsv4.left_padding_exact({"layer_types": [SLIDING, SLIDING, CSA, HCA], "num_hidden_layers": 3})
    # the engine reads the same answer off the loaded model
    from miles.train.model import load_causal_lm
    from tests.support.ckpt import tiny_hf

    deep = load_causal_lm(tiny_hf("deepseek_v4", dsv4.tiny_layers, dtype="float32"), dtype=torch.float32)
    shallow = load_causal_lm(tiny_hf("deepseek_v4", 2, dtype="float32"), dtype=torch.float32)
    assert not TorchRolloutEngine(deep).pads_exactly and TorchRolloutEngine(shallow).pads_exactly


@pytest.mark.parametrize("name", ["glm4_moe_lite", "glm_moe_dsa", "qwen3_5_moe", "deepseek_v4"])
def test_speculative_rollouts_keep_the_policys_logprobs_through_rejected_drafts(models, name):
    """Drafted by the checkpoint's MTP layer (two drafts a step), the engine's logprobs still equal
    one full forward's: each rejected draft leaves the policy's cache. GLM-4.7-Flash's attention
    caches crop it; Qwen3.5's gated delta nets fold every token into a recurrent state, which goes
    back to the state recorded after the last kept token (miles.train.speculative.RecordedStates);
    DeepSeek-V4's compressing layers are cut back to the kept tokens' prefix of what the verifying
    forward gave their compressors (RecordedCompressors)."""
    from miles.train.speculative import SpeculativeConfig
    from tests.support.ckpt import tiny_hf

    path = tiny_hf(name, family(name).tiny_layers, dtype="float32")
    engine = TorchRolloutEngine(models[name], speculative=SpeculativeConfig(steps=2), checkpoint=str(path))
    sampling = SamplingConfig(temperature=0.9, top_p=1.0, top_k=-1, max_response_len=8)
    generations = engine.generate(PROMPTS, sampling, seed=7)
    spec = engine.speculation
    print(f"{name}: {spec.accepted} of {spec.proposed} drafts accepted")
    assert 0 < spec.accepted < spec.proposed  # some drafts rejected, some taken
    if name in ("qwen3_5_moe", "deepseek_v4"):  # rewound by what was recorded, never fed again
        assert spec.rewound > 0 and spec.refed == 0, (spec.rewound, spec.refed)
    assert all(len(g.response_ids) == 8 for g in generations)
    assert max_gap(models[name], generations, 0.9) <= TOLERANCE


# GLM-5.2's tiny keeps 64 keys per query (every key at these lengths); at 4 its indexer chooses.
# With the tiny's 2 indexer heads, relu(q·k) is zero for both on a quarter of the keys, and the
# top-k among such ties depends on the padded length; with 16 heads no ties are left.
SPARSE = {"index_topk": 4, "index_n_heads": 16}


@pytest.mark.parametrize(
    ("name", "dims"),
    [("glm4_moe_lite", {}), ("glm_moe_dsa", {}), ("glm_moe_dsa", SPARSE), ("deepseek_v4", {})],
    ids=str,
)
def test_each_first_draft_is_the_mtp_layer_over_the_whole_sequence(models, name, dims):
    """Every draft made from the policy's own hidden states (the first of each step's chain) comes
    from the logits the checkpoint's MTP layer gives that position over the whole finished sequence,
    unpadded and without a cache: the drafter's cache keeps the policy's columns through left
    padding, rejected drafts and chained steps. GLM-5.2's tiny (4 layers) has a "shared" MTP layer,
    handed layer 2's top-k from the policy's forwards, each row at its column: with 64 keys kept the
    top-k is every key (and the top-k a chained draft extends is the policy's own), with 4 it is
    the indexer's choice. DeepSeek-V4's reads the policy's last streams, before their collapse."""
    from miles.train.model import load_causal_lm
    from miles.train.speculative import SpeculativeConfig
    from tests.support.ckpt import tiny_hf

    path = tiny_hf(name, family(name).tiny_layers, dtype="float32", **dims)
    model = models[name] if not dims else load_causal_lm(path, dtype=torch.float32)
    steps = 2
    engine = TorchRolloutEngine(model, speculative=SpeculativeConfig(steps=steps), checkpoint=str(path))
    drafter = engine.speculation.drafter
    shares = name == "glm_moe_dsa"
    assert drafter.shares == [shares] and (drafter.trunk_source == 2) == shares
    calls, step = [], drafter.step

    def spy(hidden, tokens, positions, attention, cache, depth=0, topk=None):
        logits, normed = step(hidden, tokens, positions, attention, cache, depth=depth, topk=topk)
        calls.append((positions.clone(), logits.clone()))
        return logits, normed

    drafter.step = spy  # records, and returns what the drafter computed
    # one batch: left-padded where the family pads exactly, else prompts of one length
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40], [70, 71, 72]]
    if not engine.pads_exactly:
        prompts = [[5, 6, 7, 8, 9, 10, 11], [40 + i for i in range(7)], [70 + i for i in range(7)]]
    sampling = SamplingConfig(temperature=0.9, top_p=1.0, top_k=-1, max_response_len=8)
    generations = engine.generate(prompts, sampling, seed=7)
    assert all(len(g.response_ids) == 8 for g in generations)
    assert 0 < engine.speculation.accepted < engine.speculation.proposed
    firsts = calls[::steps]  # each step: the block from the policy's states, then chained drafts
    reference = load_causal_lm(path, dtype=torch.float32).eval()
    gaps, compared = [], 0
    seen = {}  # what the policy's layers returned in the reference forward
    hooks = []
    if drafter.trunk_source is not None:
        layer = reference.model.layers[drafter.trunk_source]
        hooks.append(layer.register_forward_hook(lambda _m, _a, out: seen.update(topk=out[1])))
    if drafter.reads_streams:
        last = reference.model.layers[-1]
        hooks.append(last.register_forward_hook(lambda _m, _a, out: seen.update(streams=out)))
    for row, g in enumerate(generations):
        seq = torch.tensor([list(g.prompt_ids) + list(g.response_ids)])
        seen.clear()
        with torch.no_grad():
            hidden = reference.model(input_ids=seq).last_hidden_state
            hidden = seen["streams"] if drafter.reads_streams else hidden
            topk = seen["topk"][:, :-1] if drafter.trunk_source is not None else None
            positions = torch.arange(seq.shape[1] - 1).unsqueeze(0)
            want, _ = step(hidden[:, :-1], seq[:, 1:], positions, None, drafter.new_cache(), topk=topk)
        for got_positions, got in firsts:
            for col, p in enumerate(got_positions[row].tolist()):
                if p >= 0:  # not a left-padding column
                    gaps.append(float((got[row, col] - want[0, p]).abs().max()))
                    compared += 1
    for hook in hooks:
        hook.remove()
    print(f"{name}: {compared} first-draft positions, worst logit gap {max(gaps):.2e}")
    assert compared >= sum(len(p) + 2 for p in prompts), compared  # the prompts and later blocks
    assert max(gaps) <= 1e-4, max(gaps)


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "fed-again"])
def test_deepseek_v4_speculates_past_its_sliding_window_and_compression_windows(
    models, monkeypatch, recorded
):
    """DeepSeek-V4's tiny attends through a 32-token sliding window and compresses every 4 (CSA)
    and 128 (HCA) tokens: prompts of 30 to 40 tokens decoding 100 more cross the window, several
    CSA windows and an HCA window while drafts are verified and rejected. Its sliding layers keep
    the keys a rejection takes back while a step is verified (transformers' past recording), its
    compressing layers are cut back to what the kept tokens gave their compressors (windows
    closed inside a step, the CSA overlap, the open window's tokens); where a transformers' cache
    layer lacks a call that recording wraps (here one asked for that no transformers has), they go
    back to a copy from before the verifying forward and the kept tokens are fed again. Either
    way the logprobs stay a full forward's."""
    from miles.train.speculative import RecordedCompressors, SpeculativeConfig
    from tests.support.ckpt import tiny_hf

    if not recorded:
        monkeypatch.setattr(RecordedCompressors, "CALLS", (*RecordedCompressors.CALLS, "no_such_call"))

    path = tiny_hf("deepseek_v4", family("deepseek_v4").tiny_layers, dtype="float32")
    engine = TorchRolloutEngine(
        models["deepseek_v4"], speculative=SpeculativeConfig(steps=2), checkpoint=str(path)
    )
    prompts = [list(range(10, 40)), list(range(50, 90))]
    sampling = SamplingConfig(temperature=0.9, top_p=1.0, top_k=-1, max_response_len=100)
    generations = engine.generate(prompts, sampling, seed=5)
    spec = engine.speculation
    print(
        f"deepseek_v4: {spec.accepted} of {spec.proposed} accepted, {spec.rewound} rewound, {spec.refed} fed again"
    )
    assert 0 < spec.accepted < spec.proposed
    assert (spec.rewound > 0, spec.refed > 0) == (recorded, not recorded), (spec.rewound, spec.refed)
    assert all(len(g.response_ids) == 100 for g in generations)
    assert max_gap(models["deepseek_v4"], generations, 0.9) <= TOLERANCE


def _compressor_state(layer) -> dict:
    state = {"keys": layer.keys, "cumulative_length": layer.cumulative_length}
    for field in ("buffer_kv", "buffer_gate", "compressed_kv", "entry_count", "overlap_kv", "overlap_gate"):
        for name, value in getattr(layer, field, {}).items():
            state[f"{field}[{name}]"] = value
    return state


@pytest.mark.parametrize("prefix", [3, 8, 126])
def test_a_rewound_compressing_layer_holds_what_feeding_only_the_kept_tokens_leaves(models, prefix):
    """miles.train.speculative.RecordedCompressors, layer by layer: a verifying forward of 8 tokens
    (seven drafts) cut back to its first `kept` leaves each of DeepSeek-V4's CSA and HCA cache layers as feeding only
    those tokens does (sliding keys and their count; per series the open window's tokens, the
    compressed entries, their count and CSA's overlapping half), and the next token's logits the
    same, for every `kept`. After 3 tokens the step closes two CSA windows (every 4), in its first
    and fifth token, after 8 it starts one, after 126 it closes the HCA window (every 128) too."""
    import copy

    from transformers import DynamicCache

    from miles.train.speculative import (
        RecordedCompressors,
        close_windows,
        compressing_layers,
        crop_cache,
        open_windows,
    )

    model = models["deepseek_v4"]
    keyword = cache_keyword(model)
    ids = torch.randint(3, 100, (1, prefix + 9), generator=torch.Generator().manual_seed(prefix))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model(input_ids=ids[:, :prefix], use_cache=True, **{keyword: cache})
    layers = compressing_layers(cache)
    assert len(layers) == 2  # the tiny's CSA and HCA
    with RecordedCompressors(copy.deepcopy(cache), layers) as unfed:
        pass  # no forward: nothing recorded to go back by
    assert not unfed.ok
    step = ids[:, prefix : prefix + 8]
    for kept in range(1, 9):
        recorded, fed = copy.deepcopy(cache), copy.deepcopy(cache)
        with torch.no_grad():
            windows = open_windows(recorded, skip=layers)  # the sliding layers, as the decoder does
            with RecordedCompressors(recorded, layers) as record:
                model.model(input_ids=step, use_cache=True, **{keyword: recorded})
            record.rewind(kept)
            for i, layer in enumerate(recorded.layers):
                if i not in layers:
                    crop_cache(layer, 8 - kept)
            close_windows(windows)
            model.model(input_ids=step[:, :kept], use_cache=True, **{keyword: fed})
        for i in layers:
            want, got = _compressor_state(fed.layers[i]), _compressor_state(recorded.layers[i])
            assert set(got) == set(want)
            for field, value in want.items():
                if isinstance(value, torch.Tensor):
                    assert got[field].shape == value.shape, (i, kept, field)
                    gap = float((got[field] - value).abs().max()) if value.numel() else 0.0
                    assert gap <= TOLERANCE, (i, kept, field, gap)
                else:
                    assert got[field] == value, (i, kept, field, got[field], value)
        with torch.no_grad():
            nxt = ids[:, prefix + kept : prefix + kept + 1]
            logits = [model(input_ids=nxt, use_cache=True, **{keyword: c}).logits for c in (recorded, fed)]
        assert (logits[0] - logits[1]).abs().max() <= TOLERANCE, (kept, (logits[0] - logits[1]).abs().max())
