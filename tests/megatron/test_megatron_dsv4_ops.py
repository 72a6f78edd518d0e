"""DeepSeek-V4's megatron-style modules (miles.families.deepseek_v4.model) compute what transformers' classes compute.

Each module is given the weights of its transformers counterpart (DeepseekV4HyperConnection,
DeepseekV4HyperHead, DeepseekV4Attention of each layer kind, DeepseekV4SparseMoeBlock with
top-k and hash routing, clamp inactive and active) built from the tiny DeepSeek-V4 config with
every value transformers starts at a constant (sinks, position biases, hyper-connection biases
and scales, norms, the expert bias, tid2eid) drawn at random, and run on the same float32 input
in one CPU process: at most 1e-6 apart. The sequence (160 tokens) is long enough for the sliding
window (32), the heavily compressed keys (ratio 128: one entry) and the indexer's selection
(ratio 4: 40 entries, of which it keeps 16).
"""

from __future__ import annotations

import functools

import pytest
import torch

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=2, suite="stage-b-cpu")

TOL = 1e-6
SEQ, BATCH = 160, 2


@pytest.fixture(scope="module")
def megatron():
    from miles.megatron import compat
    from miles.megatron.checkpoint import single_process_group

    compat.install()
    with single_process_group():
        yield


def hf_config(**dims):
    from transformers import AutoConfig

    from miles.families.deepseek_v4 import FAMILY

    fixed = {"num_hidden_layers": 4, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 2}
    return AutoConfig.for_model("deepseek_v4", **{**FAMILY.tiny_dims, **dims}, **fixed)


def hf_model(config, seed: int = 0):
    """transformers' DeepSeek-V4 on the tiny config, its constant-initialised values drawn at random."""
    from transformers import AutoModelForCausalLM

    from miles.families.deepseek_v4 import tiny_values

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        tiny_values(model, torch.Generator().manual_seed(seed + 1))
    return model


def transformer_config(hf, **extra):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
        use_cpu_initialization=True, params_dtype=torch.float32, add_bias_linear=False, **extra,
    )  # fmt: skip


def hidden(config, seed: int = 1, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, config.hidden_size, generator=torch.Generator().manual_seed(seed)) * scale


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_hyper_connection_and_head_mix_the_streams_as_transformers(megatron):
    from miles.families.deepseek_v4.model import HyperConnection, HyperHead, hc_merge

    config = hf_config()
    layer = hf_model(config).model.layers[1]
    tc = transformer_config(config)
    streams = torch.randn(
        BATCH, SEQ, config.hc_mult, config.hidden_size, generator=torch.Generator().manual_seed(3)
    )
    ours = HyperConnection(tc, config.hidden_size, config.hc_mult, config.hc_sinkhorn_iters, config.hc_eps,
                           config.rms_norm_eps)  # fmt: skip
    ours.load_state_dict(layer.ffn_hc.state_dict())
    post, comb, collapsed = layer.ffn_hc(streams)
    s_streams = streams.transpose(0, 1)  # megatron's [s, b, n, d]
    m_post, m_comb, m_collapsed = ours(s_streams)
    assert gap(m_post.transpose(0, 1), post) <= TOL and gap(m_comb.transpose(0, 1), comb) <= TOL
    assert gap(m_collapsed.transpose(0, 1), collapsed) <= TOL
    # 4 streams: the mix is not symmetric, so a transposed one would show
    assert gap(comb, comb.transpose(-1, -2)) > 1e-3
    out = torch.randn(BATCH, SEQ, config.hidden_size, generator=torch.Generator().manual_seed(4))
    want = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.transpose(-1, -2), streams
    )  # as HF's layer
    assert gap(hc_merge(out.transpose(0, 1), s_streams, m_post, m_comb).transpose(0, 1), want) <= TOL

    head_hf = hf_model(config).model.hc_head
    head = HyperHead(tc, config.hidden_size, config.hc_mult, config.hc_eps, config.rms_norm_eps)
    head.load_state_dict({f"hc_head_{k[3:]}": v for k, v in head_hf.state_dict().items()})
    assert gap(head(s_streams).transpose(0, 1), head_hf(streams)) <= TOL


def test_yarn_and_plain_rope_frequencies_are_transformers(megatron):
    from miles.families.deepseek_v4.model import rope_tables

    config = hf_config()
    hf = hf_model(config).model.rotary_emb
    ours = rope_tables(config.to_dict())
    assert torch.equal(ours["main"], hf.main_inv_freq) and torch.equal(ours["compress"], hf.compress_inv_freq)
    assert not torch.allclose(hf.compress_inv_freq, ours["main"])  # YaRN changes them


ATTENTION_WEIGHTS = {  # ours <- transformers' DeepseekV4Attention
    "wq_a.weight": "q_a_proj.weight", "q_norm.weight": "q_a_norm.weight", "wq_b.weight": "q_b_proj.weight",
    "wkv.weight": "kv_proj.weight", "kv_norm.weight": "kv_norm.weight", "wo_a.weight": "o_a_proj.weight",
    "wo_b.weight": "o_b_proj.weight", "attn_sink": "sinks",
    "compressor.ape": "compressor.position_bias", "compressor.wkv.weight": "compressor.kv_proj.weight",
    "compressor.wgate.weight": "compressor.gate_proj.weight", "compressor.norm.weight": "compressor.kv_norm.weight",
    "indexer.linear_wq_b.weight": "compressor.indexer.q_b_proj.weight",
    "indexer.linear_weights_proj.weight": "compressor.indexer.scorer.weights_proj.weight",
    "indexer.compressor.ape": "compressor.indexer.position_bias",
    "indexer.compressor.wkv.weight": "compressor.indexer.kv_proj.weight",
    "indexer.compressor.wgate.weight": "compressor.indexer.gate_proj.weight",
    "indexer.compressor.norm.weight": "compressor.indexer.kv_norm.weight",
}  # fmt: skip


@pytest.mark.parametrize("layer", [0, 2, 3], ids=["sliding", "csa", "hca"])
def test_attention_of_each_kind_is_transformers(megatron, layer):
    from miles.families.deepseek_v4.model import Attention

    config = hf_config()
    model = hf_model(config)
    attn_hf = model.model.layers[layer].self_attn
    kind = config.layer_types[layer]
    ours = Attention(transformer_config(config), config.to_dict(), kind)
    hf_state = attn_hf.state_dict()
    state = {k: hf_state[v] for k, v in ATTENTION_WEIGHTS.items() if v in hf_state}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("_extra_state")], missing
    x = hidden(config, scale=3.0)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    with torch.no_grad():
        embeddings = {
            t: model.model.rotary_emb(x, position_ids=positions, layer_type=t) for t in ("main", "compress")
        }
        from transformers.masking_utils import create_sliding_window_causal_mask

        causal = create_sliding_window_causal_mask(
            config=config, inputs_embeds=x, attention_mask=mask, cache=None, position_ids=positions
        )
        want, _ = attn_hf(x, position_embeddings=embeddings, position_ids=positions, attention_mask=causal)
        got = ours(x.transpose(0, 1).contiguous(), positions).transpose(0, 1)
    assert gap(got, want) <= TOL, gap(got, want)
    if kind == "compressed_sparse_attention":  # the indexer selects: fewer picks than visible entries
        picks = attn_hf.compressor.indexer(x, attn_hf.q_a_norm(attn_hf.q_a_proj(x)), positions, None, layer)
        assert (
            picks.shape[-1] == config.index_topk
            and int((picks[:, -1] >= 0).sum()) == BATCH * config.index_topk
        )
        assert (SEQ // 4) > config.index_topk


def moe_layer(config, kind: str, limit: float):
    """megatron-core's MoELayer with DeepSeek-V4's router and clamped SwiGLU (local experts on CPU)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    from miles.families.deepseek_v4.model import HashRouter, SqrtSoftplusRouter

    tc = transformer_config(
        config, num_moe_experts=config.n_routed_experts, moe_router_topk=config.num_experts_per_tok,
        moe_ffn_hidden_size=config.moe_intermediate_size, ffn_hidden_size=config.moe_intermediate_size,
        moe_shared_expert_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
        moe_router_topk_scaling_factor=config.routed_scaling_factor, moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="alltoall", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        activation_func_clamp_value=limit, bias_activation_fusion=False, moe_router_dtype="fp32",
        # megatron-core refuses top-1 without it (a softmax-router rule; this router renormalises itself)
        moe_router_pre_softmax=config.num_experts_per_tok == 1,
    )  # fmt: skip
    spec = get_moe_module_spec(use_te=False, num_experts=config.n_routed_experts)
    router = (
        SqrtSoftplusRouter if kind == "moe" else functools.partial(HashRouter, vocab_size=config.vocab_size)
    )
    spec.submodules.router = router
    return build_module(spec, config=tc)


def load_moe(ours, block) -> None:
    state = block.state_dict()
    mine = {"router.weight": state["gate.weight"]}
    if "gate.e_score_correction_bias" in state:
        mine["router.expert_bias"] = state["gate.e_score_correction_bias"]
    else:
        mine["router.tid2eid"] = state["gate.tid2eid"]
    for e in range(block.experts.gate_up_proj.shape[0]):
        mine[f"experts.local_experts.{e}.linear_fc1.weight"] = state["experts.gate_up_proj"][e]  # [gate; up]
        mine[f"experts.local_experts.{e}.linear_fc2.weight"] = state["experts.down_proj"][e]
    mine["shared_experts.linear_fc1.weight"] = torch.cat(
        [state["shared_experts.gate_proj.weight"], state["shared_experts.up_proj.weight"]]
    )
    mine["shared_experts.linear_fc2.weight"] = state["shared_experts.down_proj.weight"]
    missing, unexpected = ours.load_state_dict(mine, strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("_extra_state")], missing


@pytest.mark.parametrize(
    "layer,limit,top1",
    [(3, 10.0, False), (0, 10.0, False), (3, 0.05, False), (0, 0.05, True)],
    ids=["topk", "hash", "topk-clamped", "hash-clamped-top1"],
)
def test_moe_routes_and_clamps_as_transformers(megatron, layer, limit, top1):
    dims = {"swiglu_limit": limit, **({"num_experts_per_tok": 1} if top1 else {})}
    config = hf_config(**dims)
    model = hf_model(config)
    if top1:  # a one-column table: each token's first expert
        for block in model.model.layers:
            if hasattr(block.mlp.gate, "tid2eid"):
                block.mlp.gate.tid2eid = block.mlp.gate.tid2eid[:, :1].contiguous()
    block = model.model.layers[layer].mlp
    kind = config.mlp_layer_types[layer]
    ours = moe_layer(config, kind, limit)
    load_moe(ours, block)
    x = hidden(config, scale=3.0)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    if kind == "hash_moe":
        ours.router.token_ids = ids.transpose(0, 1)
    with torch.no_grad():
        want = block(x, input_ids=ids)
        got, _ = ours(x.transpose(0, 1).contiguous())
    assert gap(got.transpose(0, 1), want) <= TOL, gap(got.transpose(0, 1), want)
    gate_up = torch.nn.functional.linear(x, block.experts.gate_up_proj[0])
    clamped = float((gate_up.abs() > limit).float().mean())
    assert (clamped > 0.5) == (limit < 1)  # the clamp is active exactly in the clamped variants


def test_hash_router_refuses_a_row_naming_an_expert_twice(megatron):
    config = hf_config()
    ours = moe_layer(config, "hash_moe", 10.0)
    ours.router.tid2eid[7] = torch.tensor([3, 3])
    ours.router.token_ids = torch.full((SEQ, BATCH), 7)
    with torch.no_grad(), pytest.raises(ValueError, match="names the same expert twice"):
        ours(hidden(config).transpose(0, 1).contiguous())
