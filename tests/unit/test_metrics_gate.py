"""Gate semantics: declarations with defaults, coordinates, the median band, trust."""

from __future__ import annotations

import math

import pytest

from miles.ci.register import register_cpu_ci
from miles.ci.registry.catalog import load_catalog
from miles.ci.registry.discover import discover
from miles.ci.registry.registration import GateDeclaration
from miles.metrics.capture import STANDARD_METRICS
from miles.metrics.gate import ERROR, FAIL, INACTIVE, PASS, GatePolicy, check_value, evaluate, is_trusted
from miles.metrics.records import MetricSeries
from miles.metrics.spec import DEFAULT_BANDS, GENERIC_BAND, LAST_STEP, Band, Coordinate, gate_spec

register_cpu_ci(est_time=1, suite="stage-a-cpu")

POLICY = GatePolicy(k=20, min_history=5, mad_k=3.0)
COORD = Coordinate("train/grad_norm", "last", "{}", LAST_STEP)
BAND = Band(rel_up=0.1, abs_floor_up=0.0, rel_down=0.1, abs_floor_down=0.0)


def _decl(metric="train/grad_norm", steps="last", constraint=(), enforce=False) -> GateDeclaration:
    return GateDeclaration("tests/e2e/test_x.py", 7, metric, steps, tuple(constraint), enforce)


def test_every_standard_metric_has_a_default_band():
    assert set(DEFAULT_BANDS) == set(STANDARD_METRICS)


def test_a_one_line_declaration_is_a_full_gate_with_the_metric_defaults():
    spec = gate_spec(_decl("train/ppo_kl"))
    assert spec.band == DEFAULT_BANDS["train/ppo_kl"]
    assert (spec.steps, spec.enforce, spec.constraint_key) == ("last", False, "{}")


def test_a_declared_constraint_overrides_only_the_sides_it_names():
    spec = gate_spec(_decl("rollout/raw_reward", constraint=[("rel_down", 0.1)]))
    default = DEFAULT_BANDS["rollout/raw_reward"]
    assert spec.band == Band(default.rel_up, default.abs_floor_up, 0.1, default.abs_floor_down)
    assert spec.constraint_key == '{"rel_down":0.1}'


def test_a_metric_without_defaults_gets_the_generic_band():
    assert gate_spec(_decl("ci/r3_mismatch_fraction")).band == GENERIC_BAND


def test_declarations_read_by_discovery_become_specs(make_tree):
    root = make_tree(
        {
            "tests/e2e/test_gated.py": """
            from miles.ci.register import register_ci_gate, register_cpu_ci
            register_cpu_ci(est_time=30, suite="stage-b-cpu")
            register_ci_gate(metric_key="train/grad_norm")
            register_ci_gate(metric_key="rollout/raw_reward", steps=[5, 2], constraint={"rel_down": 0.1}, enforce=True)
            """
        }
    )
    found = discover(root, catalog=load_catalog(), cache=False).raise_for_problems()
    specs = [gate_spec(g) for g in found.file("tests/e2e/test_gated.py").gates]
    assert [(s.metric, s.steps_key, s.enforce, s.line) for s in specs] == [
        ("train/grad_norm", "last", False, 3),
        ("rollout/raw_reward", "2,5", True, 4),
    ]


def test_steps_last_checks_the_final_value_under_one_coordinate():
    spec = gate_spec(_decl())
    verdict = evaluate(spec, _series({0: 9.0, 7: 1.0}), {}, POLICY, enforce=False)
    (check,) = verdict.checks
    assert (check.coordinate.step, check.step, check.value) == (LAST_STEP, 7, 1.0)


def test_steps_all_checks_every_logged_step():
    verdict = evaluate(
        gate_spec(_decl(steps="all")), _series({0: 1.0, 1: 2.0, 2: 3.0}), {}, POLICY, enforce=False
    )
    assert [c.coordinate.step for c in verdict.checks] == [0, 1, 2]


def test_a_declared_step_the_run_never_logged_is_an_error():
    verdict = evaluate(gate_spec(_decl(steps=(1, 9))), _series({0: 1.0, 1: 2.0}), {}, POLICY, enforce=False)
    assert verdict.status == ERROR
    assert "no value at step(s) [9]" in verdict.message and "test_x.py:7" in verdict.message


def test_a_declared_metric_that_never_appeared_is_an_error():
    verdict = evaluate(gate_spec(_decl("train/ppo_kl")), None, {}, POLICY, enforce=False)
    assert verdict.status == ERROR and "never logged" in verdict.message


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_value_is_an_error_even_on_cold_start(value):
    assert check_value(COORD, value, [], BAND, POLICY).status == ERROR


def test_below_the_minimum_history_the_check_is_inactive_not_failed():
    check = check_value(COORD, 100.0, [1.0] * 4, BAND, POLICY)
    assert check.status == INACTIVE and "cold start" in check.message


def test_the_baseline_is_the_median_of_the_newest_k_values():
    history = [10.0, 10.0, 11.0, 9.0, 10.0] + [1000.0] * 10  # newest first; old ones beyond k
    check = check_value(COORD, 10.5, history, BAND, GatePolicy(k=5, min_history=5, mad_k=0))
    assert (check.status, check.ref, check.history) == (PASS, 10.0, 5)


@pytest.mark.parametrize(("value", "status"), [(10.9, PASS), (11.1, FAIL), (9.1, PASS), (8.9, FAIL)])
def test_the_band_is_two_sided(value, status):
    assert check_value(COORD, value, [10.0] * 5, BAND, POLICY).status == status


def test_the_absolute_floor_holds_when_the_reference_is_near_zero():
    band = Band(rel_up=1.0, abs_floor_up=1e-3, rel_down=1.0, abs_floor_down=1e-3)
    assert check_value(COORD, 9e-4, [0.0] * 5, band, POLICY).status == PASS
    assert check_value(COORD, 2e-3, [0.0] * 5, band, POLICY).status == FAIL


def test_a_noisy_history_widens_the_band_by_k_mad():
    noisy = [10.0, 12.0, 8.0, 11.0, 9.0]  # median 10, MAD 1
    widened = check_value(COORD, 13.5, noisy, BAND, POLICY)
    assert widened.status == PASS and widened.high == pytest.approx(10 + 3 * 1.4826)
    assert check_value(COORD, 13.5, noisy, BAND, GatePolicy(mad_k=0)).status == FAIL


def test_a_run_is_trusted_iff_no_active_check_fails():
    spec = gate_spec(_decl(constraint=[("rel_up", 0.1), ("rel_down", 0.1)]))
    history = {spec.coordinate(LAST_STEP): [1.0] * 5}
    passing = evaluate(spec, _series({0: 1.05}), history, POLICY, enforce=True)
    failing = evaluate(spec, _series({0: 2.0}), history, POLICY, enforce=True)
    cold = evaluate(
        gate_spec(_decl("train/ppo_kl")), _series({0: 5.0}, "train/ppo_kl"), {}, POLICY, enforce=True
    )
    assert is_trusted([passing, cold]) and not is_trusted([passing, failing])


def test_a_gate_verdict_is_the_worst_of_its_checks():
    spec = gate_spec(_decl(steps="all", constraint=[("rel_up", 0.1)]))
    history = {spec.coordinate(0): [1.0] * 5, spec.coordinate(1): [1.0] * 5}
    verdict = evaluate(spec, _series({0: 1.0, 1: 3.0, 2: 1.0}), history, POLICY, enforce=False)
    assert verdict.status == FAIL
    assert verdict.message.startswith("1 PASS, 1 FAIL, 1 INACTIVE; worst at train/grad_norm @ step 1")


def test_policy_rejects_impossible_settings():
    with pytest.raises(ValueError, match="min_history <= k"):
        GatePolicy(k=3, min_history=5)


def _series(points: dict[int, float], metric: str = "train/grad_norm") -> MetricSeries:
    return MetricSeries(metric, tuple(sorted(points.items())))
