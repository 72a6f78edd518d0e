"""Golden snapshots: every recipe x platform x profile's command and environment is committed.

A change to a recipe, an overlay, a model spec or the launcher must show up as a reviewed
change of tests/snapshots/recipes/*.json. Refresh: `python -m miles.recipes snapshot --update`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from miles.ci.register import register_cpu_ci
from miles.recipes import names, variants
from miles.recipes.snapshot import compare, render

register_cpu_ci(est_time=2, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = ROOT / "tests" / "snapshots" / "recipes"


def test_committed_snapshots_match_the_generated_commands():
    problems = compare(SNAPSHOTS)
    assert not problems, "\n\n".join(problems) + "\n\nrefresh with: python -m miles.recipes snapshot --update"


def test_every_recipe_platform_and_profile_has_a_snapshot():
    for name in names():
        keys = set(json.loads((SNAPSHOTS / f"{name}.json").read_text()))
        expected = {
            f"{p.platform} {p.nodes}x{p.gpus_per_node} {p.model}" for r in variants(name) for p in r.profiles
        }
        assert keys == expected


def test_a_changed_command_is_reported_as_a_diff(tmp_path):
    shutil.copytree(SNAPSHOTS, tmp_path, dirs_exist_ok=True)
    path = tmp_path / "inkling.json"
    path.write_text(path.read_text().replace('"triton"', '"fa4"').replace('"0.6"', '"0.85"'))
    (problem,) = compare(tmp_path)
    assert problem.startswith(f"--- {path} (committed)")
    assert '-   "0.85",' in problem and '+   "0.6",' in problem


def test_snapshots_do_not_depend_on_the_machine(monkeypatch):
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("MODEL_ARGS_NUM_LAYERS", "2")
    assert render("qwen3_4b") == (SNAPSHOTS / "qwen3_4b.json").read_text()


def test_snapshot_command_checks_and_exits_zero_when_current():
    proc = subprocess.run(
        [sys.executable, "-m", "miles.recipes", "snapshot", "--dir", str(SNAPSHOTS)],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
