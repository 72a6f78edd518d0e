"""megatron-core is imported only by the adapter package `miles.megatron` and the model families
(`miles.families`: a family's own modules and its build), and written into only by the adapter.

The other packages call their functions; every write into a megatron-core module or
class is one of `miles.megatron.compat`'s entries, which `stale()` checks against the
installed release; and the release every lane installs is the one those entries were written
for, the one pyproject.toml's megatron extra pins.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=2, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "miles" / "megatron"
FAMILIES = (
    ROOT / "miles" / "families"
)  # a family's own megatron-core modules, built with the adapter's blocks
COMPAT = ADAPTER / "compat.py"
IMPORT = re.compile(r"megatron\.core|from megatron\b|import megatron\b")


def _modules(root: Path = ROOT / "miles"):
    return sorted(root.rglob("*.py"))


def test_no_module_outside_the_adapter_and_the_families_imports_megatron_core():
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _modules()
        if ADAPTER not in path.parents and FAMILIES not in path.parents
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if IMPORT.search(line)
    ]
    assert found == []


def _megatron_names(tree: ast.AST) -> set[str]:
    """Names a module binds to megatron-core modules, classes or functions (at any depth)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("megatron")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _writes_into_megatron(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = _megatron_names(tree)
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                targets += target.elts if isinstance(target, ast.Tuple) else [target]
            hit = [t for t in targets if isinstance(t, ast.Attribute) and _root(t) in names]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "delattr"):
            hit = [node] if node.args and _root(node.args[0]) in names else []
        else:
            hit = []
        out += [f"{path.relative_to(ROOT)}:{h.lineno}: {ast.unparse(h)}" for h in hit]
    return out


def test_every_write_into_megatron_core_is_in_compat():
    found = [hit for path in _modules() if path != COMPAT for hit in _writes_into_megatron(path)]
    assert found == []


def test_the_adapter_sets_attributes_dynamically_only_in_compat():
    # An object handed in as a parameter escapes the name check above; inside the adapter (the
    # only place megatron-core objects exist) any setattr/delattr must be a compat entry.
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
        for path in _modules(ADAPTER)
        if path != COMPAT
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "delattr")
    ]
    assert found == []


def test_the_write_detector_sees_compats_own_writes():
    # compat.py's writes are its entries; the detector must find them, or the test above proves nothing
    hits = _writes_into_megatron(COMPAT)
    assert any("specs.TESpecProvider" in h for h in hits)
    assert any("MoEAlltoAllTokenDispatcher.cuda_dtoh_stream" in h for h in hits)
    assert any("setattr(parallel_state" in h for h in hits)
    assert any("mp_random._get_cuda_rng_state" in h for h in hits)


def test_pyproject_pins_the_release_the_compat_entries_are_written_for():
    from miles.megatron.compat import KNOWN_RELEASE

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["megatron"] == [f"megatron-core=={KNOWN_RELEASE}"]


def test_every_lane_lock_pins_that_release():
    from miles.image.config import load_images
    from miles.image.pins import parse_lock
    from miles.megatron.compat import KNOWN_RELEASE

    config = load_images()
    versions = {
        name: parse_lock(ROOT / config.stack(name).lock_path).pins["megatron-core"].version
        for name in ("cpu", "cuda-h200", "rocm-mi350")
    }
    assert set(versions.values()) == {KNOWN_RELEASE}, versions


def test_importing_the_adapter_package_imports_nothing_heavy():
    code = (
        "import sys, miles.megatron, miles.families, miles.families.weights, miles.megatron.proof; "
        "miles.families.families(); miles.families.layout; "
        "print(sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
