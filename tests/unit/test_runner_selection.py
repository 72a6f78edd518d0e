"""Which tests a run admits: scope, cadence, PR labels (and the label safety filter)."""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from miles.ci.registry.catalog import UnknownName, load_catalog
from miles.ci.registry.discover import discover
from miles.ci.selection.policy import (
    PolicyError,
    labels_from_json,
    parse_labels,
    resolve_policy,
    write_github_outputs,
)
from miles.ci.selection.select import ScopeError, resolve_scope, select

register_cpu_ci(est_time=1, suite="stage-a-cpu")

CATALOG = load_catalog()

TREE = {
    "tests/unit/test_fast.py": "def test_x():\n    pass\n",
    "tests/e2e/test_cpu_recipe.py": """
        from miles.ci.register import register_cpu_ci
        register_cpu_ci(est_time=120, suite="stage-b-cpu")
    """,
    "tests/e2e/test_megatron.py": """
        from miles.ci.register import register_rocm_ci
        register_rocm_ci(est_time=900, suite="stage-c-4-gpu-mi350", labels=["megatron", "amd"])
    """,
    "tests/e2e/test_sglang.py": """
        from miles.ci.register import register_rocm_ci
        register_rocm_ci(est_time=600, suite="stage-c-4-gpu-mi350", labels=["sglang"])
    """,
    "tests/e2e/test_nightly.py": """
        from miles.ci.register import register_rocm_ci
        register_rocm_ci(est_time=600, suite="stage-c-4-gpu-mi350", labels=["long"], nightly=True)
    """,
    "tests/e2e/test_off.py": """
        from miles.ci.register import register_rocm_ci
        register_rocm_ci(est_time=600, suite="stage-c-4-gpu-mi350", labels=["fsdp"],
                         disabled="aiter fused MoE aborts with HIP error 700 on gfx950")
    """,
}


@pytest.fixture
def discovery(make_tree):
    return discover(make_tree(TREE), catalog=CATALOG, cache=False)


def _files(selection) -> set[str]:
    return {r.file.rsplit("/", 1)[-1] for r in selection.selected}


def _rocm(discovery, cadence="regular", labels=None):
    scope = resolve_scope(CATALOG, lane="rocm-mi350")
    parsed = None if labels is None else parse_labels(labels, CATALOG)
    return select(discovery, scope, cadence=cadence, labels=parsed)


def test_gpu_tests_run_only_when_a_label_of_theirs_is_requested(discovery):
    assert _files(_rocm(discovery, labels="run-ci-megatron")) == {"test_megatron.py"}
    assert _files(_rocm(discovery, labels="")) == set()


def test_run_ci_all_admits_every_enabled_regular_gpu_test(discovery):
    assert _files(_rocm(discovery, labels="run-ci-all")) == {"test_megatron.py", "test_sglang.py"}


def test_nightly_cadence_admits_nightly_tests_and_every_label(discovery):
    assert _files(_rocm(discovery, cadence="nightly", labels="")) == {
        "test_megatron.py",
        "test_sglang.py",
        "test_nightly.py",
    }


def test_disabled_tests_never_run_but_are_reported_with_their_reason(discovery):
    selection = _rocm(discovery, cadence="release")
    assert "test_off.py" not in _files(selection)
    (off,) = [e for e in selection.excluded if e.kind == "disabled"]
    assert "HIP error 700" in off.reason


def test_excluded_gpu_tests_say_which_label_would_select_them(discovery):
    selection = _rocm(discovery, labels="run-ci-sglang")
    (why,) = [e for e in selection.excluded if e.kind == "labels"]
    assert why.file.endswith("test_megatron.py")
    assert "run-ci-megatron" in why.reason and "run-ci-all" in why.reason


def test_no_labels_given_means_a_person_runs_the_whole_suite(discovery):
    assert _files(_rocm(discovery, labels=None)) == {"test_megatron.py", "test_sglang.py"}


def test_cpu_tests_always_run_whatever_the_labels(discovery):
    scope = resolve_scope(CATALOG, lane="cpu")
    selection = select(discovery, scope, cadence="regular", labels=parse_labels("run-ci-sglang", CATALOG))
    assert _files(selection) == {"test_fast.py", "test_cpu_recipe.py"}


@pytest.mark.parametrize(
    "label",
    ["run-ci-$(reboot)", "run-ci-a;b", "run-ci-", "run-ci--x", "bug fix", "`id`", "run-ci-a b|c"],
)
def test_labels_that_could_carry_shell_syntax_are_refused(label):
    with pytest.raises(PolicyError, match="refused"):
        parse_labels([label], CATALOG)


def test_unknown_run_ci_label_is_refused_with_the_known_ones():
    with pytest.raises(PolicyError, match="run-ci-megatron"):
        parse_labels("run-ci-megatorn", CATALOG)


def test_special_labels_set_nightly_and_bypass_fastfail():
    labels = parse_labels("nightly, bypass-fastfail run-ci-amd", CATALOG)
    assert labels.nightly and labels.bypass_fastfail and labels.domains == {"amd"}


def test_lane_and_suite_must_agree():
    with pytest.raises(ScopeError, match="lane 'rocm-mi350' runs: stage-c-4-gpu-mi350"):
        resolve_scope(CATALOG, lane="rocm-mi350", suites=["nightly-stage-c-4-gpu-mi350"])
    with pytest.raises(UnknownName, match="lane 'rocm-mi300'"):
        resolve_scope(CATALOG, lane="rocm-mi300")
    with pytest.raises(UnknownName, match="did you mean"):
        resolve_scope(CATALOG, suites=["stage-c-4-gpu-mi300x"])


def test_policy_of_a_pull_request_keeps_ci_labels_and_ignores_the_rest():
    policy = resolve_policy("pull_request", ["bug", "run-ci-megatron", "bypass-fastfail"], CATALOG)
    assert policy.cadence == "regular"
    assert policy.outputs() == {
        "cadence": "regular",
        "labels": "run-ci-megatron bypass-fastfail",
        "continue_on_error": "true",
        "run_all": "false",
        "store_history": "false",
    }
    assert policy.ignored == ("bug",)


def test_policy_of_a_schedule_is_nightly_and_a_nightly_label_widens_a_pr():
    assert resolve_policy("schedule", [], CATALOG).cadence == "nightly"
    assert resolve_policy("pull_request", ["nightly"], CATALOG).cadence == "nightly"
    assert resolve_policy("workflow_dispatch", [], CATALOG, cadence="weekly").cadence == "weekly"


def test_policy_refuses_an_unknown_event_and_a_dangerous_pr_label():
    with pytest.raises(PolicyError, match="event 'pull'"):
        resolve_policy("pull", [], CATALOG)
    with pytest.raises(PolicyError, match="refused"):
        resolve_policy("pull_request", ["run-ci-x$(id)"], CATALOG)


def test_labels_json_accepts_names_or_label_objects():
    assert labels_from_json('[{"name": "run-ci-amd", "color": "fff"}]') == ["run-ci-amd"]
    assert labels_from_json('["nightly"]') == ["nightly"]
    assert labels_from_json("") == []
    with pytest.raises(PolicyError, match="not valid JSON"):
        labels_from_json("[oops")


def test_github_outputs_are_appended_as_key_value_lines(tmp_path):
    out = tmp_path / "github_output"
    out.write_text("earlier=1\n")
    write_github_outputs({"cadence": "nightly", "labels": "run-ci-amd"}, str(out))
    assert out.read_text() == "earlier=1\ncadence=nightly\nlabels=run-ci-amd\n"
