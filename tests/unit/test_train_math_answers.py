"""Math answers are found where each dataset's responses state them and graded by equivalence."""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from miles.train.math_answers import equivalent, exact_number, final_number, normalize
from miles.train.rewards import dapo_reward, gsm8k_reward, math_reward

register_cpu_ci(est_time=1, suite="stage-a-cpu")


@pytest.mark.parametrize(
    ("given", "truth"),
    [
        ("0.5", r"\frac{1}{2}"),
        ("1/2", r"\dfrac12"),
        (r"2\sqrt{3}", r"\sqrt{12}"),
        (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}"),
        ("3\\pi", r"3 \pi"),
        ("(1, 2)", "(1,2)"),
        ("[-1, \\frac{1}{2})", "[-1,0.5)"),
        ("x = 5", "5"),
        (r"10\%", "10"),
        (r"\$18", "18"),
        (r"90^\circ", "90"),
        ("12 cm", "12"),
        (r"\text{Monday}", "monday"),
        ("1,000,000", "1000000"),
        ("x^2+2x+1", "(x+1)^2"),
    ],
)
def test_equivalent_answers_are_accepted(given, truth):
    assert equivalent(given, truth), (given, truth, normalize(given), normalize(truth))


@pytest.mark.parametrize(
    ("given", "truth"),
    [
        ("5.0001", "5"),
        ("0.333", r"\frac{1}{3}"),
        ("(1,2)", "[1,2)"),  # an interval's brackets matter
        ("(1,2,3)", "(1,2)"),
        (r"\frac{2}{4}", r"\frac{1}{2}"),  # an unreduced fraction must be written as the label writes it
        (r"\frac{10}{2}", "5"),  # an integer label takes an integer answer
        ("x+1", "x+2"),
        ("", "5"),
    ],
)
def test_different_answers_are_refused(given, truth):
    assert not equivalent(given, truth), (given, truth)


def test_sympy_is_not_asked_about_long_or_many_lettered_text():
    # would simplify equal, but is past the length sympy is trusted with
    long = "+".join(["x"] * 40)
    assert not equivalent(long, "40x")
    assert not equivalent("a+b+c", "c+b+a") or normalize("a+b+c") == normalize("c+b+a")


def test_exact_numbers_and_final_numbers():
    assert exact_number("-0.25") == exact_number("-1/4") == exact_number(r"-\frac{1}{4}")
    assert exact_number("x") is None
    assert final_number("she had 3 then 1,200.") == "1,200"
    assert final_number("steps 1 2 #### 7 and 8") == "8"
    assert final_number("no digits") is None


def test_the_math_reward_grades_the_last_box_by_equivalence():
    assert math_reward(r"so \boxed{1} or rather \boxed{\frac{6}{12}}... no: \boxed{0.5}", r"\frac12") == 1.0
    assert math_reward(r"\boxed{2\sqrt{3}}", r"\boxed{\sqrt{12}}") == 1.0
    assert math_reward("0.5", "0.5") == 0.0  # no box: no answer


def test_dapo_reads_the_answer_line_and_gsm8k_the_final_number():
    assert dapo_reward("work\nAnswer: $\\frac{1}{2}$", "0.5") == 1.0
    assert dapo_reward("work\nAnswer: 3", "4") == -1.0
    assert gsm8k_reward("3 + 4 = 7.0", "#### 7") == 1.0
    assert gsm8k_reward("7 then 8", "7") == 0.0
