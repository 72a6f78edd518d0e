"""The catalog and the registrations as a careless user and an attacker write them: every
broken input is a problem with file:line and the rule, never a traceback or a hang."""

from __future__ import annotations

import os
import time

import pytest

from miles.ci.cli import main
from miles.ci.register import register_cpu_ci
from miles.ci.registry.catalog import CatalogError, load_catalog
from miles.ci.registry.discover import discover, parse_test_file
from tests.unit.test_registry_catalog import _problems, _write_catalog

register_cpu_ci(est_time=1, suite="stage-a-cpu")

CATALOG = load_catalog()


# ------------------------------------------------------------------ catalog


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda raw: raw["suites"].update({"stage-a-cpu": 1}), '[suites."stage-a-cpu"] must be a table'),
        (lambda raw: raw["lanes"].update({"cpu": "x"}), "[lanes.cpu] must be a table"),
        (lambda raw: raw["backends"].update({"cpu": []}), "[backends.cpu] must be a table"),
        (lambda raw: raw["suites"]["stage-c-4-gpu-mi350"].update(budget_s=float("nan")), "budget_s must be a finite number > 0"),
        (lambda raw: raw["suites"]["stage-c-4-gpu-mi350"].update(budget_s=float("inf")), "budget_s must be a finite number > 0"),
        (lambda raw: raw["suites"]["stage-a-cpu"].update(shards=100000000), "shards must be between 1 and 64"),
        (lambda raw: raw.update(schema=99), "schema = 99: this miles reads catalog schema 1"),
        (lambda raw: raw.pop("schema"), "missing `schema = 1`"),
        (lambda raw: [raw.pop(k) for k in ("backends", "hardware", "labels", "lanes", "suites")], "defines no suites"),
    ],
)  # fmt: skip
def test_a_broken_catalog_is_a_catalog_error_naming_the_rule(tmp_path, edit, expected):
    assert expected in _problems(tmp_path, edit)


def test_an_empty_catalog_file_is_refused(tmp_path):
    path = tmp_path / "catalog.toml"
    path.write_text("")
    with pytest.raises(CatalogError, match="defines no suites"):
        load_catalog(path)


def test_a_catalog_that_is_not_utf8_or_missing_is_a_catalog_error(tmp_path):
    bad = tmp_path / "catalog.toml"
    bad.write_bytes(b'schema = 1\n[labels]\nx = "caf\xe9"\n')
    with pytest.raises(CatalogError, match="not valid TOML"):
        load_catalog(bad)
    with pytest.raises(CatalogError, match="cannot read it"):
        load_catalog(tmp_path / "missing.toml")


def test_a_broken_catalog_is_bad_input_exit_2(tmp_path, monkeypatch, capsys):
    path = _write_catalog(tmp_path, lambda raw: raw.update(schema=99))
    import miles.ci.registry.catalog as catalog_module

    monkeypatch.setattr(catalog_module, "CATALOG_PATH", path)
    load_catalog.cache_clear()
    try:
        (tmp_path / "tests").mkdir(exist_ok=True)
        assert main(["list", "--root", str(tmp_path)]) == 2
    finally:
        load_catalog.cache_clear()
    assert "schema = 99" in capsys.readouterr().err


# ------------------------------------------------------------------ registrations


def _parse(tmp_path, source: bytes | str, name: str = "tests/e2e/test_x.py"):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(source if isinstance(source, bytes) else source.encode())
    return parse_test_file(path, name, CATALOG)


HEAD = "from miles.ci.register import register_cpu_ci, register_rocm_ci\n"


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (
            "register_cpu_ci(est_time=1" + "0" * 400 + ', suite="stage-b-cpu")',
            "(401 digits) must be at most 86400",
        ),
        ('register_cpu_ci(est_time=1e308, suite="stage-b-cpu")', "at most 86400"),
        ('register_cpu_ci(est_time=float("inf"), suite="stage-b-cpu")', "is not a literal"),
        ('register_cpu_ci(est_time=1e999, suite="stage-b-cpu")', "must be a positive number"),
    ],
)
def test_est_time_out_of_bounds_is_a_problem_not_a_crash(tmp_path, call, expected):
    _, problems = _parse(tmp_path, HEAD + call + "\n")
    (problem,) = problems
    assert expected in problem.message and len(problem.message) < 400


def test_a_huge_est_time_does_not_abort_pytest_collection(pytester):
    pytester.makepyfile(test_huge=HEAD + "register_cpu_ci(est_time=1" + "0" * 400 + ', suite="stage-b-cpu")\n'
                        "def test_x():\n    pass\n")  # fmt: skip
    pytester.makepyfile(
        test_fine=HEAD + 'register_cpu_ci(est_time=5, suite="stage-b-cpu")\ndef test_y():\n    pass\n'
    )
    result = pytester.runpytest(
        "-p", "miles.ci.pytest_plugin", "-p", "no:cacheprovider", "--continue-on-collection-errors"
    )
    assert "INTERNALERROR" not in result.stdout.str()
    result.assert_outcomes(passed=1, errors=1)
    assert "test_huge.py:2: register_cpu_ci: est_time=" in result.stdout.str()


def test_labels_none_means_no_labels(tmp_path):
    test_file, problems = _parse(
        tmp_path, HEAD + 'register_cpu_ci(est_time=5, suite="stage-b-cpu", labels=None)\n'
    )
    assert problems == [] and test_file.registrations[0].labels == ()


def test_a_marker_used_only_inside_a_function_gets_a_message_that_says_so(tmp_path):
    source = "def helper():\n    from miles.ci.register import register_cpu_ci\n    return register_cpu_ci\n"
    _, problems = _parse(tmp_path, source)
    messages = " ".join(p.message for p in problems)
    assert "None" not in messages
    assert "register_cpu_ci at line 3 is inside a function body, which is not a registration" in messages


def test_a_bom_or_a_latin1_coding_cookie_is_read(tmp_path):
    bom = b"\xef\xbb\xbf" + (HEAD + 'register_cpu_ci(est_time=5, suite="stage-b-cpu")\n').encode()
    latin1 = ("# -*- coding: latin-1 -*-\n" + HEAD + '# caf\xe9\nregister_cpu_ci(est_time=7, suite="stage-b-cpu")\n'
              ).encode("latin-1")  # fmt: skip
    for name, source, est in (("tests/e2e/test_bom.py", bom, 5.0), ("tests/e2e/test_latin.py", latin1, 7.0)):
        test_file, problems = _parse(tmp_path, source, name)
        assert problems == [] and test_file.registrations[0].est_time == est


def test_calibrate_writes_into_a_latin1_file_without_breaking_it(tmp_path):
    from miles.ci.reports.calibrate import Proposal, apply_proposals

    source = ("# -*- coding: latin-1 -*-\n# d\xe9j\xe0\n" + HEAD + 'register_cpu_ci(est_time=7, suite="stage-b-cpu")\n'
              ).encode("latin-1")  # fmt: skip
    test_file, _ = _parse(tmp_path, source, "tests/e2e/test_latin.py")
    reg = test_file.registrations[0]
    apply_proposals(tmp_path, [Proposal(reg, 3, 10.0, 15.0)])
    after = (tmp_path / "tests/e2e/test_latin.py").read_bytes()
    assert after == source.replace(b"est_time=7", b"est_time=15")


def test_a_fifo_named_like_a_test_file_does_not_hang_discovery(tmp_path):
    (tmp_path / "tests" / "e2e").mkdir(parents=True)
    os.mkfifo(tmp_path / "tests" / "e2e" / "test_fifo.py")
    started = time.monotonic()
    found = discover(tmp_path, catalog=CATALOG, cache=False)
    assert time.monotonic() - started < 60  # a hang would block on open() forever
    (problem,) = found.problems
    assert problem.file == "tests/e2e/test_fifo.py" and "not a regular file" in problem.message


def test_format_plan_reads_each_partitions_loads_once(make_tree, monkeypatch):
    """format_plan was quadratic in shards (10,000 shards: 33 s): each line recomputed them."""
    from miles.ci.running import plan as plan_module
    from miles.ci.selection.shard import Partition

    calls = {"n": 0}
    original = Partition.loads

    def counted(self):
        calls["n"] += 1
        return original.fget(self)

    monkeypatch.setattr(Partition, "loads", property(counted))
    for n in (4, 40):
        root = make_tree({f"tests/e2e/test_{i}.py": HEAD + f'register_cpu_ci(est_time={i + 1}, suite="stage-b-cpu")\n'
                          for i in range(n)})  # fmt: skip
        options = plan_module.RunOptions(root=root, suites=("stage-b-cpu",), shards=str(min(n, 64)))
        built = plan_module.build_plan(options, CATALOG, discover(root, catalog=CATALOG, cache=False))
        calls["n"] = 0
        plan_module.format_plan(built)
        assert calls["n"] <= 2, calls
