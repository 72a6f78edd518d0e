"""The catalog: what it holds, and the rules it enforces on itself."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ci.registry.catalog import CATALOG_PATH, CatalogError, UnknownName, compress_names, load_catalog

register_cpu_ci(est_time=1, suite="stage-a-cpu")

EXPECTED_SUITES = {
    "stage-a-cpu",
    "stage-b-cpu",
    "stage-b-2-gpu-h200",
    "stage-c-2-gpu-h200",
    "stage-c-4-gpu-h200",
    "stage-c-8-gpu-h200",
    "stage-c-8-gpu-h100",
    "stage-c-4-gpu-mi350",
    "nightly-stage-c-2-gpu-mi350",
    "nightly-stage-c-4-gpu-mi350",
    "nightly-stage-c-8-gpu-mi350",
}
EXPECTED_LANES = {
    "cpu",
    "cuda-h200",
    "rocm-mi350",
    "nightly-mi350-2gpu",
    "nightly-mi350-4gpu",
    "nightly-mi350-8gpu",
}
REQUIRED_LABELS = {
    "megatron", "model-scripts", "sglang", "fsdp", "short", "long", "ckpt", "lora",
    "eval", "precision", "weight-update", "fully-async", "recipes", "amd",
}  # fmt: skip


def test_repository_catalog_has_every_suite_lane_and_label():
    catalog = load_catalog()
    assert set(catalog.suites) == EXPECTED_SUITES
    assert set(catalog.lanes) == EXPECTED_LANES
    assert REQUIRED_LABELS <= set(catalog.labels)
    assert set(catalog.backends) == {"cpu", "cuda", "rocm"}


def test_every_suite_has_a_lane_of_its_backend_and_a_consumer():
    catalog = load_catalog()
    for suite in catalog.suites.values():
        assert catalog.lanes[suite.lane].backend == suite.backend
        assert suite.consumers


def test_lanes_derive_their_suites_from_the_suites_table():
    catalog = load_catalog()
    assert [s.name for s in catalog.suites_of_lane("cpu")] == ["stage-a-cpu", "stage-b-cpu"]
    assert [s.name for s in catalog.suites_of_lane("nightly-mi350-8gpu")] == ["nightly-stage-c-8-gpu-mi350"]


def test_suite_lookup_names_backend_and_known_suites_in_its_error():
    catalog = load_catalog()
    with pytest.raises(UnknownName) as err:
        catalog.suite("stage-c-4-gpu-mi300x", "rocm")
    message = str(err.value)
    assert "'stage-c-4-gpu-mi300x' is not in the catalog for rocm" in message
    assert "stage-c-4-gpu-mi350" in message
    assert "nightly-stage-c-{2,4,8}-gpu-mi350" in message
    assert "stage-c-4-gpu-h200" not in message


def test_suite_of_another_backend_is_unknown_for_this_backend():
    with pytest.raises(UnknownName, match="belongs to cuda"):
        load_catalog().suite("stage-c-4-gpu-h200", "rocm")


def test_compress_names_folds_names_that_differ_in_one_number():
    assert compress_names(["a-2-b", "a-8-b", "a-4-b", "c"]) == "a-{2,4,8}-b, c"


def _write_catalog(tmp_path: Path, edit) -> Path:
    raw = tomllib.loads(CATALOG_PATH.read_text())
    edit(raw)
    path = tmp_path / "catalog.toml"
    path.write_text(_dump_toml(raw))
    return path


def _dump_toml(raw: dict) -> str:
    """Enough TOML for the catalog's shape: top-level scalars and two-level tables."""

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    lines = [f"{k} = {value(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for section, table in raw.items():
        if not isinstance(table, dict):
            continue
        flat = {k: v for k, v in table.items() if not isinstance(v, dict)}
        if flat:
            lines.append(f"[{section}]")
            lines += [f'"{k}" = {value(v)}' for k, v in flat.items()]
        for name, entry in table.items():
            if isinstance(entry, dict):
                lines.append(f'[{section}."{name}"]')
                lines += [f"{k} = {value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


def _problems(tmp_path: Path, edit) -> str:
    with pytest.raises(CatalogError) as err:
        load_catalog(_write_catalog(tmp_path, edit))
    return str(err.value)


def test_unchanged_catalog_round_trips_through_the_test_writer(tmp_path):
    catalog = load_catalog(_write_catalog(tmp_path, lambda raw: None))
    assert set(catalog.suites) == EXPECTED_SUITES


def test_suite_without_consumer_is_rejected(tmp_path):
    def edit(raw):
        raw["suites"]["stage-c-4-gpu-mi350"]["consumers"] = []

    assert "no consumers" in _problems(tmp_path, edit)


def test_suite_with_unknown_lane_is_rejected(tmp_path):
    def edit(raw):
        raw["suites"]["stage-c-4-gpu-mi350"]["lane"] = "rocm-mi300"

    assert "lane 'rocm-mi300' is not in [lanes]" in _problems(tmp_path, edit)


def test_gpu_count_in_name_must_equal_gpus(tmp_path):
    def edit(raw):
        raw["suites"]["stage-c-4-gpu-mi350"]["gpus"] = 8

    assert "the name says 4 GPUs but gpus = 8" in _problems(tmp_path, edit)


def test_suite_name_must_follow_the_pattern(tmp_path):
    def edit(raw):
        raw["suites"]["mi350-four"] = dict(raw["suites"]["stage-c-4-gpu-mi350"])

    assert "name must look like" in _problems(tmp_path, edit)


def test_hardware_must_match_the_suite_backend(tmp_path):
    def edit(raw):
        raw["suites"]["stage-c-4-gpu-mi350"]["backend"] = "cuda"
        raw["suites"]["stage-c-4-gpu-mi350"]["lane"] = "cuda-h200"

    assert "hardware 'mi350' is rocm but the suite's backend is cuda" in _problems(tmp_path, edit)


def test_nightly_suite_cannot_be_regular(tmp_path):
    def edit(raw):
        raw["suites"]["nightly-stage-c-2-gpu-mi350"]["cadence"] = "regular"

    assert "nightly- suite cannot have cadence 'regular'" in _problems(tmp_path, edit)


def test_suite_needs_exactly_one_of_shards_and_budget(tmp_path):
    def edit(raw):
        raw["suites"]["stage-a-cpu"]["budget_s"] = 600

    assert "exactly one of `shards`" in _problems(tmp_path, edit)


def test_lane_of_another_backend_is_rejected(tmp_path):
    def edit(raw):
        raw["suites"]["stage-c-4-gpu-mi350"]["lane"] = "cuda-h200"

    assert "lane 'cuda-h200' runs cuda but the suite is rocm" in _problems(tmp_path, edit)


def test_label_needs_a_description(tmp_path):
    def edit(raw):
        raw["labels"]["amd"] = ""

    assert "`amd` needs a one-line description" in _problems(tmp_path, edit)


def test_every_problem_is_reported_at_once(tmp_path):
    def edit(raw):
        raw["suites"]["stage-c-4-gpu-mi350"]["consumers"] = []
        raw["suites"]["stage-c-2-gpu-h200"]["gpus"] = 3

    message = _problems(tmp_path, edit)
    assert "no consumers" in message and "the name says 2 GPUs but gpus = 3" in message


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"suite": "stage-a-gpu", "est_time": 15}, "suite 'stage-a-gpu' is not in the catalog"),
        ({"suite": "stage-a-cpu", "est_time": 0}, "est_time must be a number of seconds > 0"),
        ({"suite": "stage-a-cpu", "est_time": "fast"}, "`est_time` = 'fast' should be a number"),
        ({"est_time": 15}, "missing `suite`"),
        ({"suite": "stage-b-2-gpu-h200", "est_time": 15}, "is a GPU suite; a GPU registration needs labels"),
    ],
)
def test_an_implicit_directory_needs_a_known_suite_and_an_est_time(tmp_path, entry, expected):
    def edit(raw):
        raw["implicit"]["tests/unit"] = entry

    assert expected in _problems(tmp_path, edit)


@pytest.mark.parametrize("directory", ["../tests", "/abs/tests", "tests/", "tests/./unit"])
def test_an_implicit_directory_is_a_plain_relative_path(tmp_path, directory):
    def edit(raw):
        raw["implicit"] = {directory: {"suite": "stage-a-cpu", "est_time": 15}}

    assert "must be a plain path relative to the project root" in _problems(tmp_path, edit)


def test_the_unit_directory_is_implicitly_stage_a_cpu():
    implicit = load_catalog().implicit_for("tests/unit/test_x.py")
    assert (implicit.directory, implicit.suite, implicit.est_time) == ("tests/unit", "stage-a-cpu", 15.0)
    assert load_catalog().implicit_for("tests/unitary/test_x.py") is None


def test_a_suite_declared_empty_needs_a_reason_that_says_why(tmp_path):
    def edit(raw):
        raw["suites"]["stage-c-4-gpu-mi350"]["empty"] = "FIXME"

    assert "[suites.\"stage-c-4-gpu-mi350\"]: `empty`: empty = 'FIXME' gives no diagnosis" in _problems(
        tmp_path, edit
    )
    assert load_catalog().suites["stage-c-4-gpu-mi350"].empty is None

    def diagnosed(raw):
        raw["suites"]["nightly-stage-c-8-gpu-mi350"]["empty"] = "its seed tests are not yet ported"

    catalog = load_catalog(_write_catalog(tmp_path, diagnosed))
    assert catalog.suites["nightly-stage-c-8-gpu-mi350"].empty == "its seed tests are not yet ported"
