"""`python -m miles.ci`'s commands: one table in miles/ci/cli.py, and nothing attached by name."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.cli import COMMANDS, main
from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_exactly_the_commands_of_the_table_in_its_order():
    result = subprocess.run(
        [sys.executable, "-m", "miles.ci", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    listed = re.findall(r"^    (\S+)", result.stdout, re.MULTILINE)
    assert listed == [command.name for command in COMMANDS]


@pytest.mark.parametrize("name", [command.name for command in COMMANDS])
def test_each_command_of_the_table_has_its_own_usage(name, capsys):
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m miles.ci {name} ")


def test_every_command_is_added_by_a_module_of_miles_ci_commands():
    # the CI drives the history and the gates: their commands live with the CI, so that
    # miles.metrics never imports miles.ci back
    assert {
        c.name: c.add.__module__ for c in COMMANDS if not c.add.__module__.startswith("miles.ci.commands.")
    } == {}


def _imports_by_name(tree: ast.AST) -> list[int]:
    """Lines that import a module by its name: importlib.import_module(...), __import__(...)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in ("import_module", "__import__"):
            lines.append(node.lineno)
    return lines


def test_no_part_of_the_ci_package_imports_a_module_by_its_name_string():
    found = {}
    for path in sorted((ROOT / "miles" / "ci").rglob("*.py")):
        lines = _imports_by_name(ast.parse(path.read_text()))
        if lines:
            found[path.relative_to(ROOT).as_posix()] = lines
    assert not found, found
