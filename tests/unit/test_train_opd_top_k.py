"""On-policy distillation's per-token reverse KL (miles.train.distillation.reverse_kl) against
values worked out by hand from small distributions, for every --opd-log-prob-top-k strategy and
--opd-reward-weight-mode.

The teacher's answers are shaped as SGLang's /generate scoring answer is (meta_info fields of
[logprob, token id, text] entries, one leading placeholder position for the first input token).
The distributions use powers of two, so each expected value is a small multiple of ln 2.
"""

from __future__ import annotations

import math

import pytest

from miles.ci.register import register_cpu_ci
from miles.train.distillation import ScoringRequest, TeacherError, reverse_kl

register_cpu_ci(est_time=1, suite="stage-a-cpu")

LN2 = math.log(2.0)
A, B, C = 11, 22, 33  # token ids


def _entry(prob: float, token: int) -> list:
    return [math.log(prob), token, f"<{token}>"]


def _answer(*, sampled=(), top=(), on_student=()) -> dict:
    """A scoring answer for a one-token prompt; each argument has one value per response position."""
    meta = {}
    if sampled:
        meta["input_token_logprobs"] = [[None, 0, ""], *(_entry(p, t) for p, t in sampled)]
    if top:
        meta["input_top_logprobs"] = [None, *([_entry(p, t) for p, t in pos] for pos in top)]
    if on_student:
        meta["input_token_ids_logprobs"] = [None, *([_entry(p, t) for p, t in pos] for pos in on_student)]
    return {"meta_info": meta}


def _request(student_top: list[list[tuple[float, int]]], sampled: list[tuple[float, int]]) -> ScoringRequest:
    return ScoringRequest(
        prompt_ids=(1,),
        response_ids=tuple(t for _, t in sampled),
        logprobs=tuple(math.log(p) for p, _ in sampled),
        top_logprobs=tuple(tuple((math.log(p), t) for p, t in pos) for pos in student_top),
    )


# One response position. The student puts 1/2 on A and 1/4 on B (its top 2); the teacher 1/4 on A,
# 1/2 on B. The teacher's own top 1 is B alone.
STUDENT_TOP = [[(0.5, A), (0.25, B)]]
SAMPLED = [(0.5, A)]
TEACHER_TOP1 = [[(0.5, B)]]
TEACHER_ON_STUDENT = [[(0.25, A), (0.5, B)]]


def test_top_k_zero_is_the_sampled_tokens_log_ratio():
    # log(1/2) - log(1/8) = 2 ln 2, and a second token log(1/4) - log(1/4) = 0
    request = _request([[], []], [(0.5, A), (0.25, C)])
    answer = _answer(sampled=[(0.125, A), (0.25, C)])
    assert reverse_kl(request, answer, 0, "only-student", "student_p") == pytest.approx([2 * LN2, 0.0])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # weights 2/3, 1/3: 2/3 (ln 1/2 - ln 1/4) + 1/3 (ln 1/4 - ln 1/2) = ln 2 / 3
        ("student_p", LN2 / 3),
        # weights 1/3, 2/3: ln 2 / 3 - 2 ln 2 / 3
        ("teacher_p", -LN2 / 3),
        # weights 1/2, 1/2: the two log ratios cancel
        ("none", 0.0),
    ],
)
def test_only_student_weighs_the_students_top_k(mode, expected):
    answer = _answer(top=TEACHER_TOP1, on_student=TEACHER_ON_STUDENT)
    got = reverse_kl(_request(STUDENT_TOP, SAMPLED), answer, 2, "only-student", mode)
    assert got == pytest.approx([expected], abs=1e-12)


@pytest.mark.parametrize("mode", ["student_p", "teacher_p", "none"])
def test_intersection_keeps_the_tokens_both_rank(mode):
    # only B is in both top sets: one weight of 1, ln(1/4) - ln(1/2) = -ln 2 in every weight mode
    answer = _answer(top=TEACHER_TOP1, on_student=TEACHER_ON_STUDENT)
    got = reverse_kl(_request(STUDENT_TOP, SAMPLED), answer, 2, "intersection", mode)
    assert got == pytest.approx([-LN2], abs=1e-12)


def test_student_weights_over_the_whole_vocabulary_give_the_exact_kl():
    # p = (1/2, 1/4, 1/4), q = (1/4, 1/4, 1/2) over the whole vocabulary {A, B, C}:
    # KL(p || q) = 1/2 ln 2 + 1/4 ln 1 + 1/4 ln(1/2) = ln 2 / 4
    student = [[(0.5, A), (0.25, B), (0.25, C)]]
    teacher = [[(0.25, A), (0.25, B), (0.5, C)]]
    answer = _answer(top=teacher, on_student=teacher)
    got = reverse_kl(_request(student, SAMPLED), answer, 3, "only-student", "student_p")
    assert got == pytest.approx([LN2 / 4], abs=1e-12)


def test_intersection_with_no_common_token_gives_zero():
    # the teacher's top 1 is C, which the student did not rank: the set is empty
    answer = _answer(top=[[(0.5, C)]], on_student=TEACHER_ON_STUDENT)
    assert reverse_kl(_request(STUDENT_TOP, SAMPLED), answer, 2, "intersection", "student_p") == [0]


def test_a_student_token_the_teacher_did_not_score_is_an_error():
    answer = _answer(top=TEACHER_TOP1, on_student=[[(0.5, B)]])  # A is missing from both
    with pytest.raises(TeacherError, match="position 0"):
        reverse_kl(_request(STUDENT_TOP, SAMPLED), answer, 2, "only-student", "student_p")
