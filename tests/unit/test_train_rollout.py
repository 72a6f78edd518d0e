"""The built-in rollout engine on a tiny random Qwen3: logprobs agree with a full forward,
sampling is reproducible, stops and truncation behave, and weights load from the trainer."""

from __future__ import annotations

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.train.checks import CheckFailed, check_weights_equal
from miles.train.config import SamplingConfig
from miles.train.rollout import TorchRolloutEngine, sample_tokens

register_cpu_ci(est_time=2, suite="stage-a-cpu")

VOCAB = 48


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).eval()


PROMPTS = [[3, 4, 5, 6, 7], [9], [10, 11, 12]]


def sampling(**overrides) -> SamplingConfig:
    return SamplingConfig(
        **{"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_response_len": 6, **overrides}
    )


def full_forward_logprobs(model, prompt, response, temperature):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)]


def test_logprobs_match_a_full_forward_despite_left_padding_and_kv_cache(model):
    engine = TorchRolloutEngine(model)
    for gen in engine.generate(PROMPTS, sampling(temperature=0.8), seed=3):
        expected = full_forward_logprobs(model, gen.prompt_ids, gen.response_ids, 0.8)
        assert gen.logprobs == pytest.approx(expected, abs=1e-4)


def test_same_seed_same_samples_other_seed_other_samples(model):
    engine = TorchRolloutEngine(model)
    a = engine.generate(PROMPTS * 4, sampling(), seed=1)
    assert a == engine.generate(PROMPTS * 4, sampling(), seed=1)
    assert [g.response_ids for g in a] != [
        g.response_ids for g in engine.generate(PROMPTS * 4, sampling(), seed=2)
    ]


def test_top_k_one_is_greedy_and_unaffected_by_batch_neighbours(model):
    engine = TorchRolloutEngine(model)
    batched = engine.generate(PROMPTS, sampling(top_k=1), seed=0)
    for prompt, gen in zip(PROMPTS, batched, strict=True):
        alone = engine.generate([prompt], sampling(top_k=1), seed=5)[0]
        assert gen.response_ids == alone.response_ids
        with torch.no_grad():
            first = model(input_ids=torch.tensor([prompt])).logits[0, -1].argmax().item()
        assert gen.response_ids[0] == first


def test_stop_token_ends_a_row_and_is_kept_while_others_run_to_the_length(model):
    engine = TorchRolloutEngine(model)
    greedy = engine.generate(PROMPTS, sampling(top_k=1), seed=0)
    stop = greedy[0].response_ids[1]
    first = greedy[0].response_ids.index(stop)
    gens = engine.generate(PROMPTS, sampling(top_k=1, stop_token_ids=(stop,)), seed=0)
    assert gens[0].response_ids == greedy[0].response_ids[: first + 1] and gens[0].finish_reason == "stop"
    for gen, full in zip(gens[1:], greedy[1:], strict=True):
        # Rows that never meet the stop token are unchanged by the finished row leaving the batch.
        if stop not in full.response_ids:
            assert gen.response_ids == full.response_ids and gen.finish_reason == "length"
            assert len(gen.response_ids) == 6


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    drawn = {sample_tokens(logits, sampling(top_p=0.75), gen)[0].item() for _ in range(300)}
    assert drawn == {0, 1}


def test_logprob_is_of_the_untruncated_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    ids, logp = sample_tokens(logits, sampling(top_k=1), torch.Generator().manual_seed(0))
    assert ids.item() == 0 and logp.item() == pytest.approx(torch.log(torch.tensor(0.5)).item())


def test_update_weights_loads_the_trainer_weights_and_the_check_sees_them(model):
    import copy

    engine = TorchRolloutEngine(copy.deepcopy(model))
    trainer = {k: v.detach() + 0.01 for k, v in model.state_dict().items()}
    with pytest.raises(CheckFailed, match="differs from the trainer"):
        check_weights_equal(0, engine.named_weights(), trainer)
    engine.update_weights(trainer.items())
    assert check_weights_equal(0, engine.named_weights(), trainer) == len(trainer)


def test_weight_check_honours_the_skip_list(model):
    import copy

    engine = TorchRolloutEngine(copy.deepcopy(model))
    trainer = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer["model.norm.weight"] = trainer["model.norm.weight"] + 1
    check_weights_equal(0, engine.named_weights(), trainer, ["model.norm"])
    with pytest.raises(CheckFailed, match="model.norm.weight"):
        check_weights_equal(0, engine.named_weights(), trainer, [])


def test_unknown_weight_name_is_refused(model):
    engine = TorchRolloutEngine(model)
    with pytest.raises(KeyError, match="no parameter"):
        engine.update_weights([("model.layers.9.mlp.weight", torch.zeros(1))])


def test_samples_of_one_prompt_share_its_prefill_but_are_sampled_independently(model):
    engine = TorchRolloutEngine(model)
    gens = engine.generate([PROMPTS[0]] * 6 + [PROMPTS[2]] * 2, sampling(temperature=1.5), seed=4)
    assert len({g.response_ids for g in gens[:6]}) > 1
    for gen in gens:
        expected = full_forward_logprobs(model, gen.prompt_ids, gen.response_ids, 1.5)
        assert gen.logprobs == pytest.approx(expected, abs=1e-4)


def test_causality_probe_passes_a_causal_lm_and_flags_a_model_that_sees_ahead(model):
    from types import SimpleNamespace

    from miles.train.model import CAUSALITY_TOL, causality_leak

    assert causality_leak(model) < CAUSALITY_TOL

    class SeesAhead(torch.nn.Module):  # every position's logits mix in the whole sequence
        config = SimpleNamespace(vocab_size=VOCAB)

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, VOCAB)

        def forward(self, input_ids):
            h = self.embed(input_ids)
            return SimpleNamespace(logits=h + h.mean(dim=1, keepdim=True))

    assert causality_leak(SeesAhead()) > CAUSALITY_TOL


def test_a_bf16_forward_is_judged_causal_within_its_own_rounding_noise(model):
    """bf16 rounding moves a causal model's logits by about a unit in the last place, far above
    float32's tolerance; a model that sees ahead still leaks more than that."""
    import copy
    from types import SimpleNamespace

    from miles.train.model import CAUSALITY_TOL, causality_probe

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    leak, tolerance = causality_probe(bf16)
    assert leak <= tolerance
    assert tolerance > CAUSALITY_TOL  # four bf16 units in the last place of the largest logit
    assert causality_probe(model)[1] == CAUSALITY_TOL  # float32 keeps its own

    class SeesAhead(torch.nn.Module):
        config = SimpleNamespace(vocab_size=VOCAB)

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, VOCAB, dtype=torch.bfloat16)

        def forward(self, input_ids):
            h = self.embed(input_ids)
            return SimpleNamespace(logits=h + h.mean(dim=1, keepdim=True))

    leak, tolerance = causality_probe(SeesAhead())
    assert leak > tolerance


def test_a_model_without_an_attention_layer_is_refused_by_name_before_decoding():
    # A two-layer Qwen3.5 has only Gated DeltaNet layers (its first full-attention layer is the
    # fourth): transformers' cache cannot measure the sequence, so the engine says so up front.
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.train.rollout import RolloutEngineError

    config = AutoConfig.for_model(
        "qwen3_5_moe_text", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_value_heads=2, linear_num_key_heads=1,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
    )  # fmt: skip
    assert set(config.layer_types) == {"linear_attention"}
    with pytest.raises(
        RolloutEngineError, match=r"has no attention layer .* at least one full-attention"
    ):
        TorchRolloutEngine(AutoModelForCausalLM.from_config(config))
