"""Rule-based rewards score responses the way the datasets' answers are written."""

from __future__ import annotations

import sys

import pytest

from miles.ci.register import register_cpu_ci
from miles.train.rewards import (
    RewardError,
    dapo_reward,
    deepscaler_reward,
    gsm8k_reward,
    last_boxed,
    load_reward,
    math_reward,
    score,
    synthetic_reward,
)

register_cpu_ci(est_time=1, suite="stage-a-cpu")


def test_last_boxed_takes_the_last_answer_with_nested_braces():
    assert last_boxed(r"first \boxed{1}, finally \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"


def test_last_boxed_of_a_cut_off_answer_is_none():
    assert last_boxed(r"so \boxed{\frac{1}{2") is None


@pytest.mark.parametrize(
    ("response", "label"),
    [
        (r"\boxed{42}", "42"),
        (r"\boxed{42.0}", "42"),
        (r"\boxed{ \dfrac{1}{2} }", r"\frac{1}{2}"),
        (r"\boxed{\frac12}", "0.5"),
        (r"\boxed{1,000}", "1000"),
        (r"\boxed{\text{yes}}", "yes"),
    ],
)
def test_math_reward_accepts_equivalent_forms(response, label):
    assert math_reward(response, label) == 1.0


def test_math_reward_rejects_a_wrong_or_missing_box():
    assert math_reward(r"\boxed{41}", "42") == 0.0
    assert math_reward("the answer is 42", "42") == 0.0


def test_deepscaler_scores_only_after_the_thought_and_zero_for_an_unfinished_one():
    assert deepscaler_reward(r"<think>\boxed{1}</think> so \boxed{2}", "2") == 1.0
    assert deepscaler_reward(r"<think>\boxed{2} still thinking", "2") == 0.0


def test_dapo_reward_is_plus_or_minus_one_on_the_answer_line():
    assert dapo_reward("work...\nAnswer: 17", "17") == 1.0
    assert dapo_reward("work...\nAnswer: 18", "17") == -1.0
    assert dapo_reward("no answer line", "17") == -1.0


def test_gsm8k_compares_the_final_numbers():
    assert gsm8k_reward("3 + 4 = 7, so she has 1,200 apples", "she has #### 1200") == 1.0
    assert gsm8k_reward("#### 12 then 13", "12") == 0.0
    assert gsm8k_reward("no number", "12") == 0.0


def test_synthetic_reward_is_graded_and_one_only_for_an_exact_match():
    assert synthetic_reward("7777", "7777") == 1.0
    assert synthetic_reward("7x77", "7777") == 0.75
    assert synthetic_reward("777777", "7777") == pytest.approx(4 / 6)
    assert synthetic_reward("", "7777") == 0.0


def test_synthetic_reward_gives_near_misses_partial_credit_below_a_hit():
    assert synthetic_reward("6777", "7777") == pytest.approx((0.5 * (1 - 1 / 64) + 3) / 4)
    assert synthetic_reward("6777", "7777") < synthetic_reward("7777", "7777")


def test_reward_loads_from_a_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(response, label, metadata):\n    return len(response)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in ("my_rewards.length", "my_rewards:length"):
        assert load_reward(spec)("abc", "", {}) == 3
    sys.modules.pop("my_rewards", None)


def test_unknown_reward_names_the_built_ins():
    with pytest.raises(RewardError, match="neither a built-in .*math.*gsm8k"):
        load_reward("exact")
    with pytest.raises(RewardError, match="cannot import module 'no_such_module_x'"):
        load_reward("no_such_module_x.f")


def test_dict_reward_needs_a_reward_key():
    fn = lambda response, label, metadata: {"acc": 1.0, "format": 0.5}  # noqa: E731
    assert score(fn, "r", "l", {}, "format") == 0.5
    with pytest.raises(RewardError, match="pass --reward-key"):
        score(fn, "r", "l", {}, None)


def test_non_finite_reward_is_refused():
    with pytest.raises(RewardError, match="returned nan"):
        score(lambda r, label, m: float("nan"), "r", "l", {}, None)


def test_a_reward_finite_in_float64_but_not_in_float32_is_refused_naming_the_sample():
    def huge(response, label, metadata):
        return 1e39

    with pytest.raises(RewardError) as err:
        score(huge, "r", "l", {}, None, where="prompt 3 of --prompt-data, sample 5")
    assert str(err.value).startswith(
        "reward function huge returned 1e+39 for prompt 3 of --prompt-data, sample 5"
    )
    assert "finite in float32" in str(err.value)
    assert score(lambda r, label, m: 3.0e38, "r", "l", {}, None) == 3.0e38
