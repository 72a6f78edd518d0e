"""Every CLI and invoke task ends a user error in one line with its exit code, never a
traceback; a reader that closes the output early ends the command quietly. Each test runs
the command a user types, in a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.exits import EXIT_BROKEN_PIPE, extras_providing

register_cpu_ci(est_time=7, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
CPU = "from miles.ci.register import register_cpu_ci\n"


def _run(argv: list[str], *, python: str = sys.executable, path: str | None = None, env: dict | None = None):
    return subprocess.run(
        [python, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PATH": path or os.environ.get("PATH", ""),
            **(env or {}),
        },
    )


def _one_error_line(done: subprocess.CompletedProcess, code: int, *fragments: str) -> None:
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: ")
    for fragment in fragments:
        assert fragment in line


def test_list_json_into_head_ends_quietly(make_tree):
    # enough registrations that the JSON outgrows the pipe's buffer
    root = make_tree(
        {
            f"tests/e2e/test_{i:03d}.py": CPU + f'register_cpu_ci(est_time={i + 1}, suite="stage-b-cpu")\n'
            for i in range(600)
        }
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles.ci", "list", "--root", str(root), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline() == b"{\n"
    proc.stdout.close()  # what `head -1` does
    assert proc.wait(timeout=120) == EXIT_BROKEN_PIPE
    assert proc.stderr.read() == b""


def test_a_recipe_dry_run_into_a_closed_pipe_ends_quietly():
    # The reader is gone before the script prints anything (`… --dry-run | head -0`).
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.Popen(
            [sys.executable, "scripts/run_qwen3_4b.py", "train", "--dry-run"],
            cwd=ROOT,
            stdout=write,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    finally:
        os.close(write)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_BROKEN_PIPE, err
    assert err == b""


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["history", "show", "--test", "tests/e2e/test_x.py", "--store", "postgresql://u:p%zz@db/h"], {}),
        (["history", "show", "--test", "tests/e2e/test_x.py", "--store", "mysql://u:pw@db/h"], {}),
        (["history", "untrust", "--run", "1"], {"MILES_HISTORY_URL": "host=db password=secret"}),
        (
            ["gate", "--record", ".", "--test", "tests/e2e/test_train_grpo_tiny.py", "--backend", "cpu"],
            {"MILES_HISTORY_URL": "postgresql://u:p w@db/h"},
        ),
    ],
    ids=["bad-percent", "unknown-scheme", "keyword-dsn-in-env", "gate-space"],
)
def test_a_malformed_store_url_is_bad_input(argv, env):
    done = _run(["-m", "miles.ci", *argv], env=env)
    _one_error_line(done, 2, "write postgresql://user:password@host")
    assert "secret" not in done.stderr and ":pw@" not in done.stderr


def _invoke(*argv: str, python: str = sys.executable, path: str | None = None):
    return _run(["-m", "invoke", *argv], python=python, path=path)


def test_refresh_image_with_an_unknown_variant():
    _one_error_line(
        _invoke("refresh-image", "--variant", "bogus", "--dry"), 2, "image variant 'bogus'", "cu13"
    )


def test_prepare_ckpt_with_an_unknown_recipe_or_model():
    done = _invoke("prepare-ckpt", "--recipe", "bogus", "--model", "x", "--dry")
    _one_error_line(done, 2, "unknown recipe 'bogus'; known: deepseek_v4, glm47_flash, glm5_2_744b_a40b")
    done = _invoke("prepare-ckpt", "--recipe", "qwen3_4b", "--model", "Qwen9-1B", "--dry")
    _one_error_line(done, 2, "model 'Qwen9-1B' is not Qwen3-4B")


def test_check_image_without_docker(tmp_path):
    bindir = tmp_path / "bin"  # a PATH with python and nothing else: no docker
    bindir.mkdir()
    (bindir / "python").symlink_to(sys.executable)
    done = _invoke("check-image", "ghcr.io/miles-ci/miles:cu13-20260101-deadbeef", path=str(bindir))
    _one_error_line(done, 1, "`docker` is not installed")


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """A real virtual environment holding invoke and nothing else: none of the extras
    (torch, safetensors, huggingface_hub, uv) that checkpoint and lock tasks need."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dist = metadata.distribution("invoke")
    info = next(f for f in dist.files if f.name == "METADATA").locate().parent
    package = Path(dist.locate_file("invoke"))
    for source in (package, info):
        (Path(purelib) / source.name).symlink_to(source)
    return str(python)


def test_prepare_ckpt_without_its_extras_names_the_package_and_the_extra(bare_python):
    done = _invoke("prepare-ckpt", "--recipe", "qwen3_4b", "--model", "Qwen3-4B", "--dry", python=bare_python)
    _one_error_line(done, 1, "needs the Python package 'huggingface_hub'", "miles[checkpoints]")


def test_lock_without_uv_says_so(bare_python, tmp_path):
    # A PATH with no uv on it: where the machine has one, the task would really lock (and
    # rewrite requirements/cpu.txt in this checkout).
    lock = ROOT / "requirements" / "cpu.txt"
    before = lock.read_bytes()
    (tmp_path / "bin").mkdir()
    done = _invoke("lock", "--stack", "cpu", python=bare_python, path=str(tmp_path / "bin"))
    _one_error_line(done, 1, "uv is not installed")
    assert lock.read_bytes() == before


def test_the_extras_come_from_pyproject():
    assert extras_providing("torch") == ["checkpoints", "train"]
    assert extras_providing("megatron") == ["megatron"]
    assert extras_providing("no_such_module") == []


def test_make_tiny_ckpt_refuses_an_unknown_family_even_when_dry_and_zero_layers():
    _one_error_line(
        _invoke("make-tiny-ckpt", "--family", "bogus", "--out", "unused", "--dry"),
        2,
        "--family 'bogus'",
        "qwen3",
    )
    done = _invoke("make-tiny-ckpt", "--family", "qwen3", "--out", "unused", "--layers", "0")
    assert done.returncode == 2 and done.stderr.splitlines() == [  # the command's own parser says it
        "python -m miles.ckpt make-tiny: error: argument --layers: 0: give a whole number of at least 1 "
        "(--help lists the commands and flags)"
    ], done.stderr
    assert not (ROOT / "unused").exists()
