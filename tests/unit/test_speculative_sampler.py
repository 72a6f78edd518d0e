"""The built-in engine's speculative sampler draws exactly what plain sampling draws.

A toy target and drafter (Markov tables over 6 tokens, the target's truncated by temperature,
top-k and top-p as the engine truncates) produce two tokens per row by speculative steps of one
draft: the joint distribution of (token 1, token 2) over 40,000 rows is held to plain sampling's
by a chi-square test at alpha 0.01, and the same test rejects a sampler that resamples from the
target instead of the residual after a rejected draft.
"""

from __future__ import annotations

import torch

from miles.ci.register import register_cpu_ci
from miles.train.config import SamplingConfig
from miles.train.rollout import sampling_probs
from miles.train.speculative import accept_drafts

register_cpu_ci(est_time=1, suite="stage-a-cpu")

V, ROWS, ALPHA = 6, 40_000, 0.01
SAMPLING = SamplingConfig(temperature=0.8, top_p=0.95, top_k=4, max_response_len=2)


def tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, drafter) next-token distributions [V, V] by the previous token, truncated alike."""
    gen = torch.Generator().manual_seed(seed)
    target = sampling_probs(torch.randn(V, V, generator=gen) * 2 / SAMPLING.temperature, SAMPLING)[0]
    draft = sampling_probs(torch.randn(V, V, generator=gen) * 2 / SAMPLING.temperature, SAMPLING)[0]
    return target.double(), draft.double()


def wrong_accept(target, draft, drafts, generator):
    """A common mistake: after a rejected draft, draw from the target rather than max(0, p - q)."""
    rows, k = drafts.shape
    p = target[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q = draft.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    passed = torch.rand((rows, k), generator=generator, dtype=p.dtype) * q < p
    accepted = passed.long().cumprod(dim=-1).sum(dim=-1)
    return accepted, torch.multinomial(target[torch.arange(rows), accepted], 1, generator=generator).squeeze(
        1
    )


def speculative_pairs(accept, seed: int = 1, start: int = 0) -> torch.Tensor:
    """Two tokens after `start` per row, by speculative steps of one draft each."""
    target, draft = tables()
    gen = torch.Generator().manual_seed(seed)
    context = torch.full((ROWS,), start)

    def step(ctx):
        d = torch.multinomial(draft[ctx], 1, generator=gen).squeeze(1)
        accepted, after = accept(
            torch.stack([target[ctx], target[d]], dim=1), draft[ctx].unsqueeze(1), d.unsqueeze(1), gen
        )
        return accepted, d, after

    accepted, d, after = step(context)
    first = torch.where(accepted == 1, d, after)
    second = after.clone()  # the bonus draw where the draft passed
    rejected = accepted == 0
    acc2, d2, after2 = step(first[rejected])  # the rows that emitted one token go on
    second[rejected] = torch.where(acc2 == 1, d2, after2)
    return first * V + second


def chi_square_p(pairs: torch.Tensor, start: int = 0) -> float:
    target, _ = tables()
    expected = (target[start].unsqueeze(1) * target).flatten() * len(pairs)
    observed = torch.bincount(pairs, minlength=V * V).double()
    possible = expected > 0
    assert observed[~possible].sum() == 0, "a pair plain sampling never draws was drawn"
    stat = ((observed[possible] - expected[possible]) ** 2 / expected[possible]).sum()
    dof = int(possible.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def test_speculative_samples_pass_a_chi_square_test_against_plain_sampling():
    p = chi_square_p(speculative_pairs(accept_drafts))
    print(f"chi-square p = {p:.3f} over {ROWS} rows")
    assert p > ALPHA


def test_the_chi_square_test_rejects_resampling_from_the_target_after_a_rejection():
    p = chi_square_p(speculative_pairs(wrong_accept))
    print(f"wrong rule: chi-square p = {p:.2e}")
    assert p < ALPHA


def test_a_draft_equal_to_the_target_is_always_accepted():
    target, _ = tables()
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(target[0].expand(1000, V), 1, generator=gen)
    accepted, _ = accept_drafts(target[0].expand(1000, 2, V), target[0].expand(1000, 1, V), drafts, gen)
    assert accepted.eq(1).all()
