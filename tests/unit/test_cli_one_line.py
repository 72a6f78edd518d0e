"""A user error or an interrupt ends a command in one line, never a traceback: the invoke task
that names an image variant, and `python -m miles.ci` interrupted while it reads the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=3, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]


def test_refresh_image_with_an_unknown_variant_is_one_line_exit_2():
    done = subprocess.run(
        [sys.executable, "-m", "invoke", "-r", str(ROOT), "refresh-image", "--variant", "rocm999-nope", "--dry"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: --variant: image variant 'rocm999-nope' is not in images.toml; known: "
        "cu13, rocm720-mi30x, rocm720-mi35x"
    ]
    assert done.stdout == ""


def test_ctrl_c_while_listing_a_large_tree_is_one_line_exit_130(tmp_path):
    tests = tmp_path / "tests" / "e2e"
    tests.mkdir(parents=True)
    body = 'from miles.ci.register import register_cpu_ci\nregister_cpu_ci(est_time=5, suite="stage-b-cpu")\n'
    for i in range(20_000):  # enough that discovery is still reading when the interrupt comes
        (tests / f"test_{i}.py").write_text(body + f"x = {i}\n" * 20)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles.ci", "list", "--root", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("discovery finished before the interrupt arrived; nothing was interrupted")
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["interrupted: list stopped"], err
