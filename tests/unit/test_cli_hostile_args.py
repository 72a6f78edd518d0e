"""Bad arguments and environment variables are bad input: exit 2 and one line, for every command
and invoke task, and a bad store URL creates nothing.

The issue's cases: `invoke prepare-ckpt` with no arguments, `make-tiny-ckpt --layers abc` or a
negative dimension, `check-image` with no tag or with shell metacharacters (exit 1 or a
traceback); MILES_HISTORY_TIMEOUT of abc, -1, 0, nan, inf or 1e20 and
MILES_PREFLIGHT_MIN_FREE_GB=abc (exit 1 or a traceback); a sqlite: URL in a missing folder that
created the folders; `--scan-nan` accepting -1, 2 and nan (nan hid a NaN weight); `record
--run-json` with a missing, /dev/zero or garbage file (a traceback). Each test runs the command
a user types: the invoke tasks as a subprocess, `python -m miles.<package>` through its main
in this process (argparse's exit included), with the variables set for the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=5, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=180, check=False, cwd=cwd,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def invoke(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return run("-m", "invoke", "-r", str(ROOT), *argv, **kwargs)


MAINS = {
    "miles.ci": "miles.ci.cli",
    "miles.ckpt": "miles.ckpt.cli",
    "miles.recipes": "miles.recipes.__main__",
    "miles.parallel": "miles.parallel.__main__",
}


@pytest.fixture
def command(capsys, monkeypatch):
    """command("miles.ci", *argv, env={...}) -> a finished `python -m miles.ci argv` (in process)."""
    import importlib

    def call(package: str, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        try:
            code = importlib.import_module(MAINS[package]).main(list(argv))
        except SystemExit as exc:  # argparse's usage error
            code = exc.code
        said = capsys.readouterr()
        return subprocess.CompletedProcess([package, *argv], code, said.out, said.err)

    return call


def one_line(done: subprocess.CompletedProcess, code: int = 2) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code and len(lines) == 1, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr
    return lines[0]


# --- the cases ----------------------------------------------------------------------


def test_prepare_ckpt_without_arguments(tmp_path):
    line = one_line(invoke("prepare-ckpt", cwd=tmp_path))
    assert line == "error: 'prepare-ckpt' did not receive required positional arguments: 'model'", line


def test_make_tiny_ckpt_with_a_layer_count_that_is_no_number(tmp_path):
    line = one_line(
        invoke("make-tiny-ckpt", "--family", "qwen3", "--out", str(tmp_path / "t"), "--layers", "abc")
    )
    assert "argument --layers: 'abc' is not a whole number" in line, line
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("dry", [True, False])
def test_make_tiny_ckpt_with_a_negative_dimension(tmp_path, dry):
    argv = ["make-tiny-ckpt", "--family", "qwen3", "--out", str(tmp_path / "t"), "--dim", "hidden_size=-8"]
    line = one_line(invoke(*argv, *(["--dry"] if dry else [])))
    assert "argument --dim: 'hidden_size=-8': a size or switch is at least 0" in line, line
    assert not (tmp_path / "t").exists()


def test_check_image_without_a_tag():
    line = one_line(invoke("check-image"))
    assert line == "error: 'check-image' did not receive required positional arguments: 'tag'", line


@pytest.mark.parametrize("tag", ["a;rm -rf /", "$(id)", "img:tag`touch x`", "a && b"])
def test_check_image_with_shell_metacharacters(tmp_path, tag):
    line = one_line(invoke("check-image", tag, cwd=tmp_path))
    assert f"image tag {tag!r} is not an image reference" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan", "inf", "1e20"])
def test_a_history_timeout_that_is_no_number_of_seconds(command, tmp_path, value):
    done = command("miles.ci", "history", "show", "--test", "tests/e2e/x.py", "--root", str(ROOT),
               env={"MILES_HISTORY_TIMEOUT": value, "MILES_HISTORY_URL": f"sqlite:///{tmp_path}/h.sqlite"})  # fmt: skip
    line = one_line(done)
    assert (
        line == f"error: MILES_HISTORY_TIMEOUT={value!r} must be a number of seconds above 0 and at most 3600"
    )


def test_a_preflight_free_space_that_is_no_number(command):
    done = command(
        "miles.ci", "preflight", "--lane", "cpu", "--machine-only", env={"MILES_PREFLIGHT_MIN_FREE_GB": "abc"}
    )
    assert one_line(done) == "error: MILES_PREFLIGHT_MIN_FREE_GB='abc' must be a number of GB, at least 0"


def test_a_sqlite_url_in_a_missing_folder_creates_nothing(command, tmp_path):
    url = f"sqlite:///{tmp_path}/missing/deeper/history.sqlite"
    done = command("miles.ci", "history", "show", "--test", "tests/e2e/x.py", "--store", url)
    line = one_line(done, 1)
    assert f"history store unreachable: {url}: its folder {tmp_path}/missing/deeper does not exist" in line, (
        line
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["-1", "2", "nan", "inf", "half"])
def test_scan_nan_outside_zero_to_one_is_refused(command, tmp_path, value):
    line = one_line(
        command("miles.ckpt", "validate", str(tmp_path), "--family", "qwen3", "--scan-nan", value)
    )
    assert (
        f"argument --scan-nan: {value!r}: give a fraction from 0 (headers only) to 1 (every value)" in line
    ), line


@pytest.mark.parametrize("kind", ["missing", "/dev/zero", "garbage"])
def test_record_with_a_run_json_that_is_missing_a_device_or_garbage(command, tmp_path, kind):
    path = {
        "missing": tmp_path / "absent.json",
        "/dev/zero": Path("/dev/zero"),
        "garbage": tmp_path / "g.json",
    }[kind]
    if kind == "garbage":
        path.write_bytes(b"\x00\xffnot json{")
    done = command(
        "miles.recipes", "record", "qwen3_4b", "--run-json", str(path), "--dir", str(tmp_path / "runs")
    )
    line = one_line(done)
    said = {
        "missing": "no such file",
        "/dev/zero": "is a character device, not a regular file",
        "garbage": "not JSON",
    }
    assert line.startswith(f"error: --run-json {path}: ") and said[kind] in line, line
    assert not (tmp_path / "runs").exists()


# --- more of the same kind ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--layers", "0", "0: give a whole number of at least 1"),
        ("--seed", "-1", "-1: give a whole number of at least 0"),
        ("--shard-bytes", "0", "0: give a whole number of at least 1"),
        ("--dim", "hidden_size=inf", "expected KEY=NUMBER"),
        ("--dim", "=4", "expected KEY=NUMBER"),
        ("--dim", "hidden size=4", "expected KEY=NUMBER"),
    ],
)
def test_make_tiny_ckpt_refuses_other_bad_values_even_when_dry(tmp_path, flag, value, said):
    argv = ["make-tiny-ckpt", "--family", "qwen3", "--out", str(tmp_path / "t"), flag, value, "--dry"]
    line = one_line(invoke(*argv))
    assert said in line, line


def test_prepare_ckpt_refuses_a_flag_the_recipes_plan_has_no_use_for(tmp_path):
    line = one_line(
        invoke("prepare-ckpt", "--recipe", "qwen3_4b", "--model", "tiny", "--family", "qwen3", "--dry")
    )
    assert "unrecognized arguments: --family qwen3" in line, line


def test_prepare_ckpt_refuses_a_recipes_flag_without_a_recipe(tmp_path):
    argv = ["prepare-ckpt", "--model", "m", "--family", "qwen3", "--source", "tiny:qwen3", "--model-dir",
            str(tmp_path / "models"), "--platform", "cpu", "--dry"]  # fmt: skip
    assert "unrecognized arguments: --platform cpu" in one_line(invoke(*argv))
    assert not (tmp_path / "models").exists()


def test_prepare_ckpt_with_a_scan_fraction_that_is_nan(tmp_path):
    argv = ["prepare-ckpt", "--model", "m", "--family", "qwen3", "--source", "tiny:qwen3", "--model-dir",
            str(tmp_path / "models"), "--scan-nan", "nan", "--dry"]  # fmt: skip
    assert "argument --scan-nan: 'nan'" in one_line(invoke(*argv))


def test_an_unknown_task_flag_is_exit_2(tmp_path):
    line = one_line(invoke("make-tiny-ckpt", "--family", "qwen3", "--out", str(tmp_path / "t"), "--bogus"))
    assert line == "error: No idea what '--bogus' is!", line


def test_the_ckpt_command_points_a_recipe_at_the_recipes_command(command, tmp_path):
    line = one_line(command("miles.ckpt", "prepare", "--recipe", "qwen3_4b", "--model", "tiny"))
    assert "python -m miles.recipes prepare qwen3_4b --model tiny" in line, line


@pytest.mark.parametrize(
    "argv",
    [
        ("miles.ci", "history", "show", "--test", "x", "--limit", "abc"),
        ("miles.ci", "list", "--sui", "stage-a-cpu"),
        ("miles.ckpt", "validate", "/tmp", "--fam", "qwen3"),
        ("miles.recipes", "show"),
        ("miles.parallel", "check", "--world", "8"),
    ],
)
def test_a_usage_error_of_any_command_line_is_one_line_and_spelled_out(command, argv):
    line = one_line(command(*argv))
    assert "error:" in line and line.endswith("(--help lists the commands and flags)"), line


@pytest.mark.parametrize(
    ("variable", "value"), [("MILES_PREFLIGHT_MIN_FREE_GB", "-1"), ("MILES_PREFLIGHT_MIN_FREE_GB", "nan")]
)
def test_other_preflight_settings_that_are_not_a_size(command, variable, value):
    line = one_line(
        command("miles.ci", "preflight", "--lane", "cpu", "--machine-only", env={variable: value})
    )
    assert f"{variable}={value!r} must be a number of GB" in line, line


def test_a_preflight_flag_that_is_not_a_size(command):
    line = one_line(
        command("miles.ci", "preflight", "--lane", "cpu", "--machine-only", "--min-free-gb", "nan")
    )
    assert "--min-free-gb='nan' must be a number of GB" in line, line


def test_a_history_url_variable_in_a_missing_folder_creates_nothing(command, tmp_path):
    url = f"sqlite:///{tmp_path}/nope/history.sqlite"
    done = command("miles.ci", "history", "show", "--test", "x", env={"MILES_HISTORY_URL": url})
    assert "does not exist" in one_line(done, 1)
    assert list(tmp_path.iterdir()) == []


def test_record_with_a_run_json_that_is_a_fifo_does_not_hang(command, tmp_path):
    fifo = tmp_path / "run.json"
    os.mkfifo(fifo)
    line = one_line(command("miles.recipes", "record", "qwen3_4b", "--run-json", str(fifo)))
    assert "is a FIFO, not a regular file" in line, line


def test_record_with_json_that_is_not_a_run_record(command, tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"lane": "cpu", "attempts": 7}')
    line = one_line(command("miles.recipes", "record", "qwen3_4b", "--run-json", str(path)))
    assert "not a run record of the CI runner" in line, line
