"""`python -m miles.ci list|audit|manifest`, run as a user runs them: real processes on real trees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from miles.ci.register import register_cpu_ci
from miles.ci.registry.catalog import load_catalog
from miles.ci.registry.discover import discover
from miles.ci.reports.audit import audit

register_cpu_ci(est_time=3, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
HEADER = "from miles.ci.register import register_cpu_ci, register_cuda_ci, register_rocm_ci\n"
HEAVY_MODULES = ("torch", "transformers", "megatron", "sglang", "psycopg", "matplotlib", "numpy")


def _ci(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def _bad_tree(make_tree) -> Path:
    return make_tree(
        {
            "tests/e2e/test_generic.py": HEADER
            + 'register_rocm_ci(est_time=900, suite="stage-c-4-gpu-mi350", labels=["amd"], '
            'disabled="Disable due to failure")\n',
            "tests/e2e/test_typo.py": HEADER
            + 'register_rocm_ci(est_time=900, suite="stage-c-4-gpu-mi300x", labels=["amd"])\n',
        }
    )


def test_audit_strict_passes_on_this_repository():
    result = _ci("-m", "miles.ci", "audit", "--strict")
    assert result.returncode == 0, result.stdout + result.stderr


def test_audit_strict_fails_on_generic_reason_and_unknown_rocm_suite(make_tree):
    root = _bad_tree(make_tree)
    result = _ci("-m", "miles.ci", "audit", "--strict", "--root", str(root))
    assert result.returncode == 1
    assert (
        "tests/e2e/test_generic.py:2: register_rocm_ci: disabled='Disable due to failure' gives no diagnosis"
        in result.stderr
    )
    assert (
        "tests/e2e/test_typo.py:2: register_rocm_ci: suite 'stage-c-4-gpu-mi300x' is not in the catalog for rocm"
        in result.stderr
    )


def test_audit_without_strict_reports_but_exits_zero(make_tree):
    result = _ci("-m", "miles.ci", "audit", "--root", str(_bad_tree(make_tree)))
    assert result.returncode == 0 and "**error** [registration]" in result.stdout


def test_audit_dates_disabled_tests_from_git_history(make_tree):
    root = make_tree(
        {
            "tests/e2e/test_off.py": HEADER
            + 'register_cuda_ci(est_time=60, suite="stage-c-2-gpu-h200", labels=["sglang"])\n'
            + 'register_rocm_ci(est_time=60, suite="stage-c-4-gpu-mi350", labels=["amd"], '
            'disabled="numba missing from the rocm720 image")\n'
        }
    )
    git = {"GIT_AUTHOR_DATE": "2026-01-02T03:04:05Z", "GIT_COMMITTER_DATE": "2026-01-02T03:04:05Z"}
    for command in (
        ["git", "init", "-q"],
        ["git", "add", "."],
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "add test"],
    ):
        subprocess.run(command, cwd=root, check=True, env={**os.environ, **git})
    report = audit(load_catalog(), discover(root), root=root)
    (entry,) = report.disabled
    assert entry.since == "2026-01-02" and entry.age_days >= 0
    assert entry.registration.disabled == "numba missing from the rocm720 image"
    assert "| rocm | stage-c-4-gpu-mi350 | tests/e2e/test_off.py:3 |" in report.to_markdown()


def test_audit_shows_the_cuda_rocm_coverage_gap(make_tree):
    root = make_tree(
        {
            "tests/e2e/test_cuda_only.py": HEADER
            + 'register_cuda_ci(est_time=60, suite="stage-c-2-gpu-h200", labels=["sglang"])\n',
            "tests/e2e/test_both.py": HEADER
            + 'register_cuda_ci(est_time=60, suite="stage-c-2-gpu-h200", labels=["sglang"])\n'
            + 'register_rocm_ci(est_time=60, suite="nightly-stage-c-2-gpu-mi350", labels=["amd"])\n',
        }
    )
    report = audit(load_catalog(), discover(root), root=root)
    gaps = {(c.file, c.cuda, c.rocm) for c in report.coverage}
    assert ("tests/e2e/test_cuda_only.py", "enabled", "-") in gaps
    assert ("tests/e2e/test_both.py", "enabled", "enabled") in gaps
    assert any(
        "test_cuda_only.py runs on CUDA but has no ROCm registration" in f.message for f in report.findings
    )


def test_audit_flags_placeholder_est_times(make_tree):
    files = {
        f"tests/e2e/test_p{i}.py": HEADER + 'register_cpu_ci(est_time=600, suite="stage-b-cpu")\n'
        for i in range(4)
    }
    files["tests/e2e/test_measured.py"] = HEADER + 'register_cpu_ci(est_time=137, suite="stage-b-cpu")\n'
    root = make_tree(files)
    report = audit(load_catalog(), discover(root), root=root)
    (finding,) = [f for f in report.findings if f.kind == "placeholder-est-time"]
    assert "suite 'stage-b-cpu': 4 of 5 tests have est_time=600" in finding.message


def test_audit_reports_empty_suites_and_unused_labels(make_tree, catalog_with_an_empty_suite):
    root = make_tree({"tests/unit/test_a.py": "def test_a():\n    pass\n"})
    report = audit(catalog_with_an_empty_suite, discover(root), root=root)
    kinds = {(f.kind, f.message) for f in report.findings}
    assert (
        "empty-suite",
        "suite 'stage-c-4-gpu-mi350' has no enabled test, so its lane 'rocm-mi350' fails; register one, or "
        'declare it empty with its reason in miles/ci/catalog.toml (empty = "...")',
    ) in kinds
    assert ("unused-label", "label 'lora' is used by no registration") in kinds
    # a suite the catalog declares empty is told with its reason, and is no error
    assert any(k == "declared-empty" and "nightly-stage-c-8-gpu-mi350" in m for k, m in kinds)
    # without .github/workflows the consumers' workflow files are missing too
    assert {f.kind for f in report.errors} == {"missing-workflow", "empty-suite"}


def test_list_json_is_valid_and_filters_by_backend(make_tree):
    root = make_tree(
        {
            "tests/e2e/test_x.py": HEADER
            + 'register_cuda_ci(est_time=60, suite="stage-c-2-gpu-h200", labels=["sglang"])\n'
            + 'register_rocm_ci(est_time=70, suite="nightly-stage-c-2-gpu-mi350", labels=["amd"], nightly=True)\n',
            "tests/unit/test_y.py": "",
        }
    )
    result = _ci("-m", "miles.ci", "list", "--json", "--backend", "rocm", "--root", str(root))
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["problems"] == []
    assert [(r["file"], r["suite"], r["nightly"]) for r in payload["registrations"]] == [
        ("tests/e2e/test_x.py", "nightly-stage-c-2-gpu-mi350", True)
    ]


def test_list_filters_by_lane_and_label(make_tree):
    root = make_tree(
        {
            "tests/e2e/test_x.py": HEADER
            + 'register_cuda_ci(est_time=60, suite="stage-c-2-gpu-h200", labels=["sglang"])\n'
            + 'register_rocm_ci(est_time=70, suite="nightly-stage-c-2-gpu-mi350", labels=["amd"])\n',
        }
    )
    by_lane = json.loads(
        _ci("-m", "miles.ci", "list", "--json", "--lane", "cuda-h200", "--root", str(root)).stdout
    )
    assert [r["backend"] for r in by_lane["registrations"]] == ["cuda"]
    by_label = json.loads(
        _ci("-m", "miles.ci", "list", "--json", "--label", "amd", "--root", str(root)).stdout
    )
    assert [r["backend"] for r in by_label["registrations"]] == ["rocm"]


def test_list_of_the_repository_is_valid_json():
    result = _ci("-m", "miles.ci", "list", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["registrations"]


def test_unknown_suite_on_the_command_line_is_one_line_and_exit_2():
    result = _ci("-m", "miles.ci", "list", "--suite", "stage-c-4-gpu-mi300x")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: suite 'stage-c-4-gpu-mi300x' is not in the catalog")


def test_list_exits_1_and_names_the_problem_when_a_registration_is_broken(make_tree):
    result = _ci("-m", "miles.ci", "list", "--root", str(_bad_tree(make_tree)))
    assert result.returncode == 1 and "test_typo.py:2" in result.stderr


def test_manifest_lists_enabled_and_disabled_tests_per_suite(make_tree):
    root = make_tree(
        {
            "tests/e2e/test_x.py": HEADER
            + 'register_rocm_ci(est_time=70, suite="nightly-stage-c-8-gpu-mi350", labels=["amd"])\n',
            "tests/e2e/test_y.py": HEADER
            + 'register_rocm_ci(est_time=70, suite="nightly-stage-c-8-gpu-mi350", labels=["amd"], '
            'disabled="rccl all-to-all hangs at 8 ranks, see #41")\n',
        }
    )
    result = _ci("-m", "miles.ci", "manifest", "--json", "--root", str(root))
    assert result.returncode == 0, result.stderr
    suite = json.loads(result.stdout)["suites"]["nightly-stage-c-8-gpu-mi350"]
    assert suite["lane"] == "nightly-mi350-8gpu" and suite["gpus"] == 8
    assert [t["file"] for t in suite["enabled"]] == ["tests/e2e/test_x.py"]
    assert suite["disabled"] == [
        {"file": "tests/e2e/test_y.py", "reason": "rccl all-to-all hangs at 8 ranks, see #41"}
    ]


def test_list_imports_no_heavy_package():
    result = _ci("-X", "importtime", "-m", "miles.ci", "list")
    assert result.returncode == 0, result.stderr
    imported = {
        line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line
    }
    assert imported.isdisjoint(HEAVY_MODULES), sorted(imported & set(HEAVY_MODULES))


def test_a_refused_registration_stays_visible_in_list_and_manifest(make_tree, capsys):
    import json as _json

    from miles.ci.cli import main as cli_main

    root = make_tree(
        {
            "tests/e2e/test_typo.py": """
                from miles.ci.register import register_rocm_ci
                register_rocm_ci(est_time=60, suite="stage-c-4-gpu-mi350", labels=["amd"], disabled="flaky")
            """
        }
    )
    cli_main(["list", "--root", str(root), "--json"])
    listed = _json.loads(capsys.readouterr().out)["registrations"]
    (refused,) = [r for r in listed if r["status"] == "refused"]
    assert (refused["file"], refused["suite"], refused["backend"]) == (
        "tests/e2e/test_typo.py",
        "stage-c-4-gpu-mi350",
        "rocm",
    )
    assert "gives no diagnosis" in refused["rule"]
    cli_main(["manifest", "--root", str(root), "--json"])
    manifest = _json.loads(capsys.readouterr().out)
    (entry,) = manifest["suites"]["stage-c-4-gpu-mi350"]["refused"]
    assert entry["status"] == "refused" and entry["line"] == 2
    cli_main(["list", "--root", str(root)])
    assert "refused: " in capsys.readouterr().out


GATED_GPU_TEST = (
    "from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci\n"
    'register_cuda_ci(est_time=600, suite="stage-c-4-gpu-h200", labels=["megatron"])\n'
    'register_rocm_ci(est_time=600, suite="stage-c-4-gpu-mi350", labels=["amd"])\n'
    'register_ci_gate(metric_key="train/grad_norm")\n'
)


def test_audit_names_every_gate_that_no_scheduled_run_feeds(make_tree, tmp_path_factory):
    text = (ROOT / "miles/ci/catalog.toml").read_text()
    start, end = text.index("[schedules]"), text.index("# Directories whose test files")
    scratch = tmp_path_factory.mktemp("catalog") / "catalog.toml"
    scratch.write_text(text[:start] + text[end:])  # the catalog with no scheduled workflow
    root = make_tree({"tests/e2e/test_gated.py": GATED_GPU_TEST})
    catalog = load_catalog(scratch)
    findings = [
        f for f in audit(catalog, discover(root, catalog=catalog)).findings if f.kind == "no-baseline"
    ]
    assert [(f.severity, f.message.split(" has ")[0]) for f in findings] == [
        ("warning", "tests/e2e/test_gated.py:4: gate train/grad_norm on (cuda, stage-c-4-gpu-h200)"),
        ("warning", "tests/e2e/test_gated.py:4: gate train/grad_norm on (rocm, stage-c-4-gpu-mi350)"),
    ]
    assert (
        "no scheduled workflow runs stage-c-4-gpu-h200 at a nightly or weekly cadence" in findings[0].message
    )


def test_with_this_catalog_every_gpu_gate_has_a_baseline_source(make_tree):
    root = make_tree({"tests/e2e/test_gated.py": GATED_GPU_TEST})
    assert [f for f in audit(load_catalog(), discover(root)).findings if f.kind == "no-baseline"] == []
    repository = audit(load_catalog(), discover(ROOT)).findings
    assert [f.message for f in repository if f.kind == "no-baseline" and f.severity != "info"] == []
