"""miles.parallel agrees with megatron-core on seeded random layouts, VPP and MoE included.

A seeded generator draws 160 layouts (world sizes 1-8; tp, pp, vpp, cp, ep, etp, sp, explicit
stage sizes; dense, MoE, biased-MoE and DSA models, the DSA one sharing its top-k across layers), mostly from the divisors of the world
size so that the deeper rules are reached, sometimes not so that the grid rules fire too.
megatron-core 0.16.1 tries them all for real: one gloo process group per world size, every
layout of that size in turn (see miles.megatron.proof). The two must agree on every one:
the same first broken rule, or both accept and split the layers the same way. The only
allowed difference is where miles is documented as stricter (`documented_stricter`).
"""

from __future__ import annotations

import random

import pytest

from miles.ci.register import register_cpu_ci
from miles.families import family
from miles.megatron.proof import Case, prove
from miles.parallel import RULE_IDS, ModelShape, ParallelLayout, stage_sizes, validate
from miles.parallel.numbers import divisors
from miles.parallel.rules import middle

register_cpu_ci(est_time=35, suite="stage-b-cpu")

SEED = 1012
COUNT = 160
WORLDS = (1, 2, 3, 4, 6, 8)
# Each layout costs a process-group build on every rank: the big worlds are drawn less often.
WORLD_WEIGHTS = (2, 3, 2, 3, 1, 1)
MODELS = (
    ModelShape("dense4", 4, 8, 2),
    ModelShape("dense6", 6, 12, 3),
    ModelShape("dense8", 8, 16, 16),
    ModelShape("dense12", 12, 8, 4),
    ModelShape("moe4", 4, 8, 8, 8),
    ModelShape("moe8", 8, 16, 4, 16, moe_ffn_hidden_size=96),
    ModelShape("moe6-e12", 6, 8, 2, 12, moe_ffn_hidden_size=36),
    ModelShape("moe-bias", 4, 8, 8, 8, bias=True),
    ModelShape("dsa5", 5, 16, 16, 8, "dsa"),
    # GLM-5.2's first 8 layers: 3, 4, 5 and 7 reuse the top-k of layers 2 and 6
    ModelShape("glm8", 8, 16, 16, 8, "dsa", shared_index_layers=(3, 4, 5, 7)),
)
# The rules of a family's own limits (miles.families: Inkling builds no context parallelism,
# DeepSeek-V4 splits o_groups 4 over tp) and of an unpadded vocabulary of odd rows, each met
# first by a layout of its own beside the random ones
INKLING4 = ModelShape("inkling4", 4, 8, 8, 8, limits=family("inkling").limits({}))
DSV4_O4 = ModelShape("dsv4-o4", 4, 24, 24, 8, limits=family("deepseek_v4").limits({"o_groups": 4}))
VOCAB151 = ModelShape("vocab151", 4, 8, 8, vocab_size=151)
FAMILY_CASES = [
    Case(ParallelLayout(cp=2), 2, INKLING4),
    Case(ParallelLayout(tp=3), 3, DSV4_O4),
    Case(ParallelLayout(tp=2, sp=True), 2, VOCAB151),
    Case(ParallelLayout(tp=2, sp=True, ep=2), 2, INKLING4),  # what the families do build
]


def _divisor(rng: random.Random, n: int, top: int = 8) -> int:
    return rng.choice([d for d in divisors(n) if d <= top])


def _grid(rng: random.Random, world: int, moe: bool) -> tuple[int, int, int, int, int | None]:
    """tp, pp, cp, ep, etp: usually degrees whose grids fit the world size, so the deeper rules
    are reached; sometimes any small degrees, so the grid rules fire too."""
    if rng.random() < 0.2:
        tp, pp, cp = rng.randint(1, 8), rng.randint(1, 4), rng.choice((1, 2))
        ep = rng.randint(1, 8) if moe else 1
        return tp, pp, cp, ep, rng.choice((None, 1, rng.randint(1, 4)))
    tp = _divisor(rng, world)
    pp = _divisor(rng, world // tp, 4)
    cp = _divisor(rng, world // (tp * pp), 2)
    etp = rng.choice((None, None, 1, _divisor(rng, world // pp)))
    expert_tp = tp if etp is None else etp
    ep = _divisor(rng, world // (pp * expert_tp)) if moe and world % (pp * expert_tp) == 0 else 1
    if not moe and rng.random() < 0.05:
        ep = 2
    return tp, pp, cp, ep, etp


def random_layouts(seed: int = SEED, count: int = COUNT) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        world = rng.choices(WORLDS, WORLD_WEIGHTS)[0]
        model = rng.choice(MODELS)
        tp, pp, cp, ep, etp = _grid(rng, world, model.moe)
        vpp = rng.choice((1, 2, 3, 4)) if rng.random() < (0.5 if pp > 1 else 0.1) else None
        first = last = None
        if pp > 1 and rng.random() < 0.3:
            first = rng.randint(1, model.num_layers)
            last = rng.choice((None, rng.randint(1, model.num_layers)))
        config = ParallelLayout(
            tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, sp=rng.random() < 0.6, vpp=vpp,
            first_stage_layers=first, last_stage_layers=last,
            cp_comm_type=rng.choice((None, "p2p", "all_gather")) if cp > 1 else None,
        )  # fmt: skip
        cases.append(Case(config, world, model))
    return cases


def documented_stricter(config: ParallelLayout, model: ModelShape) -> bool:
    """Where miles refuses what megatron-core 0.16.1 accepts (see rules._stage_layers): explicit
    first and last stage sizes on a single stage (megatron-core builds only the last size), or
    sizes adding up to more than the model (it builds a negative middle stage)."""
    if config.first_stage_layers is None or config.last_stage_layers is None:
        return False
    layers, stages = middle(config, model)
    return stages < 0 or layers < 0


CASES = random_layouts() + FAMILY_CASES


@pytest.fixture(scope="module")
def verdicts():
    return prove(CASES)


def test_the_generator_covers_vpp_moe_and_meets_every_rule_first():
    ours = [validate(c.layout, c.world_size, c.model) for c in CASES]
    assert len(CASES) >= 100
    assert sum(c.layout.vpp is not None for c in CASES) >= 30
    assert sum(c.model.moe for c in CASES) >= 50
    assert {v.rules[0] for v in ours if not v.ok} == set(RULE_IDS)  # each rule is met first at least once
    assert sum(v.ok for v in ours) >= 20


def _read_back(flags: tuple[str, ...], num_layers: int) -> ParallelLayout:
    """The layout the trainer parses from `flags` (its own parser, then the one layout parser)."""
    from miles.train.args import build_parser

    return ParallelLayout.from_args(build_parser().parse_args(["--hf-checkpoint", "-", *flags]), num_layers)


def test_every_random_layout_survives_the_trainer_flags_and_back():
    respelled = 0
    for case in CASES:
        layout, layers = case.layout, case.model.num_layers
        assert _read_back(layout.trainer_flags(), layers) == layout, layout.describe()
        per_rank, stages = layers // layout.pp, layout.vpp
        even = layout.first_stage_layers is None and layout.last_stage_layers is None
        if stages and even and layout.pp > 1 and layers % layout.pp == 0 and per_rank % stages == 0:
            # Megatron-LM's other spelling of the same virtual pipeline
            other = (*_without_vpp(layout.trainer_flags()), "--num-layers-per-virtual-pipeline-stage",
                     str(per_rank // stages))  # fmt: skip
            assert _read_back(other, layers) == layout, layout.describe()
            respelled += 1
    assert respelled >= 3


def _without_vpp(flags: tuple[str, ...]) -> tuple[str, ...]:
    i = flags.index("--num-virtual-stages-per-pipeline-rank")
    return (*flags[:i], *flags[i + 2 :])


def test_megatron_cores_rank_grids_have_the_layouts_sizes(verdicts):
    checked = 0
    for case, theirs in zip(CASES, verdicts, strict=True):
        if not theirs.groups:  # initialize_model_parallel refused the layout
            continue
        layout, world = case.layout, case.world_size
        want = {
            "tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "dp": layout.dp(world),
            "ep": layout.ep, "etp": layout.expert_tp, "edp": layout.expert_dp(world),
        }  # fmt: skip
        for name, size in want.items():
            groups = theirs.groups[name]
            assert {len(g) for g in groups} == {size}, f"{layout.describe()} on {world}: {name} {groups}"
            assert sorted(r for g in groups for r in g) == list(range(world)), f"{name} {groups}"
        checked += 1
    assert checked >= 60


def test_miles_and_megatron_core_agree_on_every_random_layout(verdicts):
    disagreements = []
    for case, theirs in zip(CASES, verdicts, strict=True):
        ours = validate(case.layout, case.world_size, case.model)
        if theirs.agrees_with(ours):
            if ours.ok and theirs.layers_per_stage != stage_sizes(case.layout, case.model):
                disagreements.append(f"{ours.summary()}: megatron-core splits {theirs.layers_per_stage}")
            continue
        if theirs.ok and ours.rules[0] == "stage-layers" and documented_stricter(case.layout, case.model):
            continue
        disagreements.append(f"{ours.headline()} | megatron-core: {theirs.summary()}")
    assert not disagreements, "\n".join(disagreements)
