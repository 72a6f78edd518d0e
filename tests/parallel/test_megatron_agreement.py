"""miles.parallel's verdicts equal megatron-core's own, layout by layout.

megatron-core 0.16.1 runs for real: one helper process forks a gloo group per world size
(1, 2, 3, 4, 8 ranks) and tries every layout of that size in turn. The table records the
exact message megatron-core gives for each layout it refuses; a megatron-core upgrade that
changes a message or a verdict fails here first. Seeded random layouts are proven the same
way in tests/parallel/test_random_layouts.py.
"""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from miles.families import family
from miles.megatron.proof import Case, prove
from miles.parallel import ModelShape, ParallelLayout, stage_sizes, validate
from miles.recipes import names, variants

register_cpu_ci(est_time=30, suite="stage-b-cpu")

DENSE = ModelShape("Qwen3-4B-4layer", 4, 32, 8)
MOE = ModelShape("Qwen3-30B-A3B-4layer", 4, 32, 4, 128)
# GLM-5.2's first 5 layers: indexers on layers 0-2, layers 3 and 4 reuse layer 2's top-k
GLM = ModelShape("GLM-5.2-5layer", 5, 64, 64, 256, "dsa", shared_index_layers=(3, 4))
KV3 = ModelShape("kv3", 4, 12, 3)
KV2 = ModelShape("kv2", 4, 8, 2)
E8 = ModelShape("moe8", 4, 8, 8, 8)
E12 = ModelShape("moe12", 4, 8, 8, 12)
D8 = ModelShape("dense8", 8, 8)
BIASED = ModelShape("biased-moe8", 4, 8, 8, 8, bias=True)
ODD = ModelShape("moe8-ffn35", 4, 8, 8, 8, moe_ffn_hidden_size=35)
# the shipped families' own limits (miles.families), on small shapes: Inkling builds no context
# parallelism, DeepSeek-V4 splits its grouped output projection (o_groups 3 here) over tp
INKLING = ModelShape("inkling4", 4, 8, 8, limits=family("inkling").limits({}))
DSV4 = ModelShape("dsv4-o3", 4, 8, 8, limits=family("deepseek_v4").limits({"o_groups": 3}))
VOCAB151 = ModelShape("vocab151", 4, 8, 8, vocab_size=151)  # an unpadded vocabulary of odd rows
P = ParallelLayout

EP_DENSE = "ValueError: num_moe_experts must be non None to use expert-parallel."
HEADS_3 = "ValueError: num_attention_heads (32) must be a multiple of tensor_model_parallel_size (3)."
LAYERS_PP = "AssertionError: num_layers should be divisible by pipeline_model_parallel_size"
DSA_CP = "AssertionError: Currently context parallelism is not supported by DSAttention!"
SHARED_START = (
    "StageStartsOnSharedLayer: a pipeline stage starts at layer 3, which reuses the DSA top-k of an earlier "
    "layer (cross-layer index sharing) held by another stage; every stage must start on a layer that runs its "
    "own indexer (shared layers: 3, 4): change --decoder-first-pipeline-num-layers / "
    "--decoder-last-pipeline-num-layers or the virtual stages (python -m miles.parallel check names one)"
)
EXPERTS_EP = (
    "AssertionError: assert self.config.num_moe_experts % ep_size == 0 "
    "(megatron/core/transformer/moe/moe_layer.py:101)"
)


def expert_copies() -> str:
    return (
        "ValueError: expert weight experts.local_experts.0.linear_fc1.weight is copied on the 2 ranks of each "
        "tensor-parallel group (tp 2, etp 1), each copy trained on its rank's sequence-parallel tokens, but "
        "megatron-core reduces it over data parallel only (it marks expert weights for the expert-data-parallel "
        "reduction only with expert_model_parallel_size > 1): the copies would drift apart; use "
        "--expert-tensor-parallel-size 2 or --expert-model-parallel-size >= 2"
    )


def expert_grid(world: int, size: int) -> str:
    return f"RuntimeError: world_size ({world}) is not divisible by expert_tensor_model_pipeline_parallel size ({size})"


# (world size, layout, model, miles' first violated rule or None, megatron-core's error or None)
TABLE = [
    (1, P(), None, None, None),
    (1, P(sp=True), DENSE, None, None),  # Megatron-LM turns sp off with tp=1; so does the proof
    (1, P(), GLM, None, None),
    (2, P(tp=2, sp=True), DENSE, None, None),
    (2, P(tp=2), None, None, None),
    (2, P(pp=2), DENSE, None, None),
    (2, P(cp=2), DENSE, None, None),
    (2, P(cp=2), GLM, "dsa-cp", DSA_CP),
    (2, P(ep=2), DENSE, "ep-needs-moe", EP_DENSE),
    (2, P(ep=2), MOE, None, None),
    (2, P(pp=2), GLM, "layers-pp", LAYERS_PP),
    (2, P(pp=2, first_stage_layers=2), GLM, None, None),
    (
        2,
        P(pp=2, first_stage_layers=3),
        GLM,
        "dsa-index-share-stage",
        SHARED_START,
    ),  # miles' GLM model refuses
    (
        2,
        P(pp=2, first_stage_layers=3, last_stage_layers=3),
        MOE,
        "stage-layers",
        "ValueError: Mismatch: -2 middle layers remaining but 0 middle PP stages available.",
    ),
    (2, P(tp=2, ep=2, sp=True), MOE, "expert-grid", expert_grid(2, 4)),
    (6, P(tp=3, ep=2, etp=1), DENSE, "heads-tp", HEADS_3),  # three rules broken: megatron-core's order wins
    (
        2,
        P(vpp=2),
        D8,
        "vpp-needs-pp",
        "RuntimeError: pipeline-model-parallel size should be greater than 1 with interleaved schedule",
    ),
    (2, P(pp=2, vpp=2), D8, None, None),
    (
        2,
        P(pp=2, vpp=3),
        D8,
        "vpp-layers",
        "AssertionError: num_layers_per_pipeline_rank 4 should be divisible by vp_size 3",
    ),
    (
        2,
        P(tp=2),
        E8,
        "moe-tp-needs-sp",
        "ValueError: During training, performance may degrade if MoE and tensor parallelismare enabled without also enabling sequence parallelism.",
    ),
    (2, P(tp=2, sp=True), E8, None, None),
    (2, P(tp=2, sp=True), VOCAB151, "vocab-tp", "AssertionError: 151 is not divisible by 2"),
    (1, P(), VOCAB151, None, None),
    (2, P(cp=2), INKLING, "family-cp", "ValueError: " + INKLING.limits.cp_problem(2)),
    (2, P(tp=2, sp=True), INKLING, None, None),
    (2, P(tp=2, sp=True), DSV4, "family-tp", "ValueError: " + DSV4.limits.tp_problem(2)),
    (
        2,
        P(tp=2, sp=True, etp=2),
        BIASED,
        "moe-bias-etp",
        "AssertionError: Bias in Moe is only supported when ETP==1",
    ),
    # at ep 1, an expert copied on both tp ranks (etp 1) is reduced as a dense weight: miles' trainer refuses
    (2, P(tp=2, sp=True, etp=1), BIASED, "expert-copies-tp", expert_copies()),
    (2, P(tp=2, sp=True, etp=1), E8, "expert-copies-tp", expert_copies()),
    (2, P(tp=2, sp=True, ep=2, etp=1), BIASED, None, None),  # ep 2: the copies are summed over edp
    (2, P(tp=2, sp=True, etp=2), E8, None, None),  # the bias-free MoE every recipe trains
    (
        2,
        P(tp=2, sp=True, etp=2),
        ODD,
        "moe-ffn-etp",
        "AssertionError: 19 is not divisible by 2 when instantiating ColumnParallelLinear when instantiating SequentialMLP",
    ),
    (
        3,
        P(tp=3),
        DENSE,
        "heads-tp",
        HEADS_3,
    ),
    (3, P(pp=3), MOE, "layers-pp", LAYERS_PP),
    (3, P(pp=3, first_stage_layers=2), MOE, None, None),
    (3, P(ep=3), E8, "experts-ep", EXPERTS_EP),
    (4, P(tp=2, pp=2, ep=4, etp=1), MOE, "expert-grid", expert_grid(4, 8)),  # the seeds' MI350 failure
    (4, P(tp=2, pp=2, ep=2, etp=1, sp=True), MOE, None, None),  # ... and its fix
    (4, P(tp=4, sp=True, ep=4, etp=1), MOE, None, None),
    (4, P(tp=4, sp=True, ep=4), MOE, "expert-grid", expert_grid(4, 16)),  # etp defaults to tp
    (4, P(tp=8), None, "dense-grid", "RuntimeError: world_size (4) is not divisible by 8"),
    (
        4,
        P(tp=4),
        KV3,
        "kv-heads-tp",
        "ValueError: num_query_groups (3) must be a multiple or divisor of tensor_model_parallel_size (4).",
    ),
    (4, P(tp=4), DENSE, None, None),
    (4, P(tp=4), KV2, None, None),  # fewer KV heads than tp ranks: replicated, allowed
    (4, P(tp=2, cp=2), DENSE, None, None),
    (4, P(tp=2, cp=2, pp=2), DENSE, "dense-grid", "RuntimeError: world_size (4) is not divisible by 8"),
    (4, P(pp=4), GLM, "layers-pp", LAYERS_PP),
    (4, P(pp=4, first_stage_layers=2), GLM, "dsa-index-share-stage", SHARED_START),
    (
        4,
        P(pp=4, vpp=2, first_stage_layers=3),
        ModelShape("m9", 9, 8),
        "stage-layers",
        "ValueError: number of layers at first stage: 3must be divisible by virtual pipelineparallel degree 2",
    ),
    (
        4,
        P(pp=4, vpp=2, first_stage_layers=2),
        ModelShape("m11", 11, 8),
        "stage-layers",
        "ValueError: number of layers on each middle pipeline rank:3 must be divisible by virtualpipeline "
        "parallel degree 2",
    ),
    (4, P(tp=2, pp=2, vpp=2, sp=True, ep=2, etp=1), ModelShape("moe8-8layer", 8, 8, 8, 8), None, None),
    (
        4,
        P(pp=4, first_stage_layers=1, last_stage_layers=1),
        GLM,
        "stage-layers",
        "ValueError: number of layers at middle stage: 3 must be divisible bythe middle pipeline model "
        "parallel size 2",
    ),
    (8, P(tp=2, pp=2, ep=2, etp=1, sp=True), MOE, None, None),
    (8, P(tp=4, sp=True, pp=2, ep=8, etp=1), MOE, "expert-grid", expert_grid(8, 16)),
    (8, P(tp=8, sp=True, ep=8, etp=1), GLM, None, None),
    (8, P(ep=8), MOE, None, None),
    (8, P(tp=2, pp=2, cp=2, ep=2, etp=1, sp=True), GLM, "dsa-cp", DSA_CP),
    (8, P(tp=2, ep=3, sp=True), MOE, "expert-grid", expert_grid(8, 6)),
    (8, P(ep=8), E12, "experts-ep", EXPERTS_EP),
]

# Where miles is deliberately stricter than megatron-core: (world, layout, model, miles' rule,
# what megatron-core does instead).
STRICTER = [
    # megatron-core accepts first+last stages larger than the model and builds a middle stage
    # of -2 layers; miles refuses the layout.
    (3, P(pp=3, first_stage_layers=3, last_stage_layers=3), MOE, "stage-layers", (3, -2, 3)),
    # With one stage that is both first and last, megatron-core builds only the last size:
    # 1 of the model's 4 layers.
    (1, P(first_stage_layers=1, last_stage_layers=1), MOE, "stage-layers", (1,)),
]


def _id(row) -> str:
    world, config, model = row[:3]
    tag = f"-{row[3]}" if len(row) == 4 else ""
    return f"w{world}-{config.describe()}-{model.name if model else 'grid'}{tag}".replace("·", "-")


# Every verified GPU profile of every recipe form, with its model's real shape.
RECIPE_PROFILES = [
    (
        p.world_size,
        p.parallel,
        recipe.resolve(p.model, env={}).shape,
        f"{recipe.name}-{recipe.variant}-{p.platform}",
    )
    for name in names()
    for recipe in variants(name)
    for p in recipe.profiles
    if p.platform != "cpu"
]


@pytest.fixture(scope="module")
def megatron_verdicts():
    rows = TABLE + STRICTER + RECIPE_PROFILES
    cases = [Case(config, world, model) for world, config, model, *_ in rows]
    unique = list(dict.fromkeys(cases))  # recipe forms often share a layout and a model
    verdicts = dict(zip(unique, prove(unique), strict=True))
    return {_id(row): verdicts[case] for row, case in zip(rows, cases, strict=True)}


def test_the_table_covers_at_least_thirty_layouts_and_every_rule():
    from miles.parallel import RULE_IDS

    assert len(TABLE) >= 30
    assert {row[3] for row in TABLE} - {None} == set(RULE_IDS)


@pytest.mark.parametrize("row", TABLE, ids=_id)
def test_miles_verdict_equals_megatron_core(row, megatron_verdicts):
    world, config, model, rule, megatron_error = row
    ours = validate(config, world, model)
    theirs = megatron_verdicts[_id(row)]
    assert (ours.rules[:1] or (None,))[0] == rule
    assert theirs.error == megatron_error
    assert theirs.agrees_with(ours)
    if ours.ok and model is not None:
        assert theirs.layers_per_stage == stage_sizes(config, model)


@pytest.mark.parametrize("row", STRICTER, ids=_id)
def test_miles_is_stricter_only_where_recorded(row, megatron_verdicts):
    world, config, model, rule, megatron_split = row
    theirs = megatron_verdicts[_id(row)]
    assert validate(config, world, model).rules[:1] == (rule,)
    assert theirs.ok and theirs.layers_per_stage == megatron_split


@pytest.mark.parametrize("row", RECIPE_PROFILES, ids=_id)
def test_megatron_core_accepts_every_verified_recipe_profile(row, megatron_verdicts):
    world, config, model, _ = row
    theirs = megatron_verdicts[_id(row)]
    assert theirs.ok, theirs.summary()
    assert theirs.layers_per_stage == stage_sizes(config, model)


def test_megatron_rank_grids_match_the_layout(megatron_verdicts):
    row = next(r for r in TABLE if r[:2] == (4, P(tp=2, pp=2, ep=2, etp=1, sp=True)))
    groups = megatron_verdicts[_id(row)].groups
    assert groups["tp"] == [[0, 1], [2, 3]]
    assert groups["pp"] == [[0, 2], [1, 3]]
    assert groups["ep"] == [[0, 1], [2, 3]]
    assert groups["etp"] == [[0], [1], [2], [3]]
