"""DeepSeek-V4 built by miles.families.deepseek_v4.model computes what transformers' DeepseekV4ForCausalLM computes.

A tiny random DeepSeek-V4 checkpoint with every switch of the published Flash model (its layer
pattern sliding, sliding, CSA, HCA; hash routing on the first three layers, sqrt-softplus top-k
with expert bias after; 4 hyper-connection streams; YaRN on the compressed layers' rope; clamped
SwiGLU; per-head sinks; grouped output projection) and random values where transformers starts at
a constant, is read into the megatron model through the family's weight mapping
(miles/families/deepseek_v4/__init__.py) and compared with the HF model in float32 on 320-token
sequences (sliding window 32 active, 2 heavily compressed entries, 80 CSA entries of which the
indexer keeps 16): logits at most 1e-5 apart, for the published switches and for each switch
turned another way. Split over two CPU ranks (TP 2 with sequence parallelism and EP 2, as the
recipes lay experts out; EP 2; PP 2) the model computes the same logits, and the gradient norm of
the mean token cross-entropy, as the trainer gets it (megatron's DDP, schedule and distributed
optimizer), equals transformers' own on the same tokens (what FSDP computes over the HF model)
within 1e-4 relative; the shards the two ranks save as the trainer saves them load into the
one-process model as exactly the checkpoint's weights. Each variant first checks that its switch is in the checkpoint's config.json,
and that transformers' indexer has no near-tie at its top-k boundary on the probe (a pick that
flips on a last-bit difference would make the comparison meaningless, not the model wrong).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.ci.register import register_cpu_ci
from tests.support import ranks
from tests.support.ckpt import tiny_hf
from tests.support.results import results

register_cpu_ci(est_time=20, suite="stage-b-cpu")

TOL = 1e-5
SEQ, BATCH = 320, 2
MARGIN = 1e-5  # the least relative gap at the indexer's k-th place the comparison trusts
PROBES = 5  # probes tried, in order, for one that is not within MARGIN of a flip
CSA_ALL, HCA_ALL = [4] * 44, [128] * 44
WORKER = Path(__file__).with_name("dsv4_parallel_worker.py")
GRAD_REL = 1e-4

VARIANTS = {  # name: (tiny dims, what config.json must then say)
    "published switches": ({}, {"hc_mult": 4}),
    "every layer CSA": ({"compress_ratios": CSA_ALL}, {"layer_types": ["compressed_sparse_attention"] * 4}),
    "every layer HCA": ({"compress_ratios": HCA_ALL}, {"layer_types": ["heavily_compressed_attention"] * 4}),
    "indexer keeps every entry": ({"index_topk": 128}, {"index_topk": 128}),
    "plain compress rope": ({"rope_parameters": {"rope_type": "default"}}, {}),
    "clamp active": ({"swiglu_limit": 0.05}, {"swiglu_limit": 0.05}),
    "top-1 routing": ({"num_experts_per_tok": 1}, {"num_experts_per_tok": 1}),
    "3 streams": ({"hc_mult": 3}, {"hc_mult": 3}),
}


@pytest.fixture(scope="module")
def megatron():
    from miles.megatron import compat
    from miles.megatron.checkpoint import single_process_group

    compat.install()
    with single_process_group():
        yield


def load_megatron(path, config):
    """The megatron DeepSeek-V4 with every weight read from the checkpoint files through the mapping."""
    from megatron.core.transformer import MLATransformerConfig

    from miles.ckpt.shards import CheckpointReader
    from miles.families.deepseek_v4 import FAMILY as family

    tc = MLATransformerConfig(
        **family.transformer_fields(config), params_dtype=torch.float32, use_cpu_initialization=True,
        perform_initialization=False,
    )  # fmt: skip
    model = family.build_model(tc, config, int(config["vocab_size"]))
    state = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
    filled = set()
    with CheckpointReader(path) as reader, torch.no_grad():
        for name, pieces in family.weights(config):
            assert name in state, f"the mapping names {name}, which the model does not have"
            for piece in pieces:
                source = family.source_name(piece.hf_name, reader.files.weight_map)
                rows = reader.read_rows(source, piece.start, piece.stop)
                state[name][piece.at : piece.at + rows.shape[0]].copy_(rows)
            filled.add(name)
    assert not sorted(set(state) - filled), sorted(set(state) - filled)[:5]  # every weight has a source
    return model.eval()


def indexer_margin(hf, tokens) -> float:
    """The least relative gap between transformers' k-th and (k+1)-th indexer score over the probe's
    queries that have more visible entries than k (inf when none has)."""
    margins = []

    def keeper(indexer):
        def keep(module, args, scores):  # the scorer's [b, s, T] scores, before the causal mask
            k = indexer.index_topk
            for t in range(scores.shape[1]):
                visible = (t + 1) // indexer.compress_rate
                if visible > k:
                    top = scores[:, t, :visible].topk(k + 1, dim=-1).values
                    gap = (top[:, k - 1] - top[:, k]).abs() / top[:, k - 1].abs().clamp_min(1e-30)
                    # entries where every head's relu(q.k) is 0 score exactly 0 in both models alike;
                    # ties among them break the same way (same values, same shapes, same topk)
                    gap = gap.masked_fill(top[:, k - 1] == 0, float("inf"))
                    margins.append(float(gap.min()))

        return keep

    indexers = [
        layer.self_attn.compressor.indexer
        for layer in hf.model.layers
        if getattr(layer.self_attn.compressor, "indexer", None) is not None
    ]
    handles = [ix.scorer.register_forward_hook(keeper(ix)) for ix in indexers]
    try:
        with torch.no_grad():
            hf(input_ids=tokens)
    finally:
        for handle in handles:
            handle.remove()
    return min(margins, default=float("inf"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_transformers(megatron, variant):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    dims, says = VARIANTS[variant]
    path = tiny_hf("deepseek_v4", 4, dtype="float32", **dims)
    config = json.loads((path / "config.json").read_text())
    for key, want in says.items():
        assert config[key] == want, (key, config[key])
    if variant == "plain compress rope":
        assert config["rope_parameters"]["compress"]["rope_type"] == "default"
    hf_logging.set_verbosity_error()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    margins = {}
    for seed in range(PROBES):  # the first probe on which no pick is within MARGIN of flipping
        tokens = torch.randint(3, 500, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
        margins[seed] = indexer_margin(hf, tokens)
        if margins[seed] >= MARGIN:
            break
    else:
        pytest.fail(f"every probe is ill-conditioned: the indexer's least k-th gap per probe {margins}")
    model = load_megatron(path, config)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    with torch.no_grad():
        want = hf(input_ids=tokens).logits
        got = model(tokens, positions)
    gap = float((want - got).abs().max())
    assert gap <= TOL, f"{variant}: logits {gap:.3g} apart (|logits| up to {float(want.abs().max()):.3g})"


PARALLEL = ("tp2sp", "ep2", "pp2")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, dict[str, tuple[list[dict], Path]]]:
    """Each layout's ranks' results and the folder its model's shards were saved in (one launch)."""
    path = tiny_hf("deepseek_v4", 4, dtype="float32")
    saved = {layout: tmp_path_factory.mktemp(f"saved-{layout}") for layout in PARALLEL}
    launched = results(
        ranks.launch(
            WORKER,
            str(path),
            json.dumps([[k, str(v)] for k, v in saved.items()]),
            preload=ranks.MEGATRON_PRELOAD,
        )
    )
    by_layout = {r["layout"]: r["ranks"] for r in launched}
    assert sorted(by_layout) == sorted(PARALLEL), by_layout
    return path, {layout: (by_layout[layout], saved[layout]) for layout in PARALLEL}


@pytest.mark.parametrize("layout", PARALLEL)
def test_two_ranks_give_transformers_logits_and_gradient_norm(megatron, two_ranks, layout):
    path, by_layout = two_ranks
    found, saved = by_layout[layout]
    assert any("gap" in r for r in found)  # the last pipeline stage compared the logits
    for result in found:
        if "gap" in result:
            assert result["gap"] <= TOL, result
        assert result["grad_norm_rel"] <= GRAD_REL, result
    if layout != "pp2":  # its MTP layer's training forward gives SGLang's MTP logits (PP 2 is refused)
        assert [r["mtp_gap"] for r in found if "mtp_gap" in r] and all(
            r["mtp_gap"] <= TOL for r in found if "mtp_gap" in r
        ), found
    # the shards the two ranks saved load into the one-process model as the checkpoint's weights
    from megatron.core import dist_checkpointing

    from miles.megatron.checkpoint import model_state_template

    config = json.loads((path / "config.json").read_text())
    model = load_megatron(path, config)
    want = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    with torch.no_grad():
        for param in want:
            model.state_dict(keep_vars=True)[param].zero_()
    loaded = dist_checkpointing.load(model_state_template([model]), str(saved))["model0"]
    model.load_state_dict(loaded, strict=False)
    for name, value in model.state_dict().items():
        if name in want:
            assert torch.equal(value, want[name]), name


@pytest.mark.parametrize(
    "parallel,message",
    [
        ({"context_parallel_size": 2}, "--context-parallel-size 2: DeepSeek-V4's sliding windows"),
        ({"tensor_model_parallel_size": 4, "sequence_parallel": True}, "does not divide o_groups 2"),
    ],
)
def test_a_layout_the_attention_cannot_split_is_refused(megatron, parallel, message):
    from megatron.core.transformer import MLATransformerConfig
    from transformers import AutoConfig

    from miles.families import UnmappedModel
    from miles.families.deepseek_v4 import FAMILY
    from miles.families.deepseek_v4 import FAMILY as family

    config = AutoConfig.for_model("deepseek_v4", **FAMILY.tiny_dims, num_hidden_layers=4).to_dict()
    tc = MLATransformerConfig(**family.transformer_fields(config), **parallel, use_cpu_initialization=True)
    with pytest.raises(UnmappedModel, match=message):
        family.build_model(tc, config, int(config["vocab_size"]))


def test_published_names_load_the_same_weights(megatron, tmp_path):
    """DeepSeek's published files name the tensors without transformers' `model.` prefix and with
    embed.weight / hc_head_fn: the mapping reads either form into the same model."""
    from safetensors.torch import load_file, save_file

    from miles.ckpt.shards import INDEX_NAME
    from miles.families.deepseek_v4 import published_name

    saved = tiny_hf("deepseek_v4", 4, dtype="float32")
    published = tmp_path / "published"
    published.mkdir()
    index = json.loads((saved / INDEX_NAME).read_text())
    renamed = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {published_name(k): v for k, v in load_file(saved / shard).items()}
        save_file(tensors, published / shard, metadata={"format": "pt"})
        renamed.update({k: shard for k in tensors})
    assert "embed.weight" in renamed and "layers.0.attn.wq_a.weight" in renamed and "hc_head_fn" in renamed
    (published / INDEX_NAME).write_text(json.dumps({**index, "weight_map": renamed}))
    config = json.loads((saved / "config.json").read_text())
    ours, theirs = load_megatron(saved, config).state_dict(), load_megatron(published, config).state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours if not k.endswith("_extra_state"))


def test_the_mtp_layer_trains_alone_on_what_sglang_drafts_with(megatron):
    """With its MTP layer training (Model.train_mtp, what --enable-mtp-training calls), a training
    forward returns the MTP layer's logits beside the policy's: those of the layer wired as SGLang
    0.5.23's DeepseekV4ModelNextN wires it, from transformers' own modules holding the checkpoint's
    mtp.0.* (tests/support/dsv4_mtp.py), within 1e-5, and far from the policy's; the built-in
    engine's drafter (miles.train.speculative.MtpDrafter) gives them too. Its cross-entropy
    on the token two ahead reaches the MTP parameters alone (the policy's streams, the embedding
    and the output layer enter detached), with the gradient norm transformers' modules give."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from miles.megatron.mtp import mtp_targets
    from tests.support.dsv4_mtp import NextN, following_tokens

    hf_logging.set_verbosity_error()
    path = tiny_hf("deepseek_v4", 4, dtype="float32")
    config = json.loads((path / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for seed in range(PROBES):
        tokens = torch.randint(3, 500, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
        if indexer_margin(hf, tokens) >= MARGIN:
            break
    else:
        pytest.fail("every probe is ill-conditioned at the indexer's top-k")
    model = load_megatron(path, config)
    model.train_mtp()
    model.train()
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    logits, (mtp,) = model(tokens, positions)
    reference = NextN(path, hf)
    hf.requires_grad_(False)
    want, _ = reference(reference.streams(tokens), following_tokens(tokens))
    gap = float((want - mtp).abs().max())
    assert gap <= TOL, f"MTP logits {gap:.3g} apart"
    assert float((want - logits).abs().max()) > 1e-2  # the MTP layer predicts otherwise than the policy
    # the built-in engine's drafter, loading mtp.0.* by its own names, computes the same
    from miles.train.speculative import MtpDrafter

    drafter = MtpDrafter(hf, str(path))
    assert drafter.reads_streams
    with torch.no_grad():
        drafted, _ = drafter.step(
            reference.streams(tokens), following_tokens(tokens), positions, None, drafter.new_cache()
        )
    assert float((drafted - want).abs().max()) <= TOL, float((drafted - want).abs().max())

    targets, mask = mtp_targets(tokens, torch.ones(BATCH, SEQ - 1), SEQ, 0)

    def loss_of(out):
        ce = torch.nn.functional.cross_entropy(
            out[:, : SEQ - 1].transpose(1, 2), targets[:, : SEQ - 1], reduction="none"
        )
        return (ce * mask).sum() / mask.sum()

    loss_of(mtp).backward()
    trunk = [n for n, p in model.named_parameters() if not n.startswith("mtp.") and p.grad is not None]
    assert not trunk, trunk[:5]  # the policy gets no gradient from the MTP loss
    grads = {n: p.grad for n, p in model.named_parameters() if n.startswith("mtp.") and p.grad is not None}
    assert len(grads) >= 20 and all(bool(torch.isfinite(g).all()) for g in grads.values()), sorted(grads)[:5]
    loss_of(want).backward()
    theirs = [
        p.grad for n, p in reference.named_parameters() if not n.startswith("hf.") and p.grad is not None
    ]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])))
    want_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in theirs])))
    print(f"MTP logits gap {gap:.2e}; MTP gradient norm {norm:.6g} against transformers' {want_norm:.6g}")
    assert abs(norm - want_norm) <= GRAD_REL * want_norm, (norm, want_norm)
