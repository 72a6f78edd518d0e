from __future__ import annotations

import textwrap
from pathlib import Path

import pytest


@pytest.fixture
def make_tree(tmp_path: Path):
    """Write {relative path: source} under a fresh project root and return the root."""

    def write(files: dict[str, str]) -> Path:
        for rel, source in files.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source).lstrip("\n"), encoding="utf-8")
        return tmp_path

    return write


EMPTY_REASON = "the seed framework's nightly 8-GPU MI350 tests are not yet ported"


@pytest.fixture
def catalog_with_an_empty_suite(tmp_path: Path, monkeypatch):
    """The project's catalog with nightly-stage-c-8-gpu-mi350 declared empty (with EMPTY_REASON),
    as the CLI reads it: every suite of the real catalog has tests now, and how a declared-empty
    suite is told needs one."""
    import miles.ci.registry.catalog as catalog_module

    header = "[suites.nightly-stage-c-8-gpu-mi350]\n"
    text = catalog_module.CATALOG_PATH.read_text(encoding="utf-8")
    assert header in text and "\nempty = " not in text.split(header, 1)[1].split("\n[", 1)[0]
    path = tmp_path / "catalog-with-empty.toml"
    path.write_text(text.replace(header, f'{header}empty = "{EMPTY_REASON}"\n'), encoding="utf-8")
    monkeypatch.setattr(catalog_module, "CATALOG_PATH", path)
    catalog_module.load_catalog.cache_clear()
    yield catalog_module.load_catalog()
    catalog_module.load_catalog.cache_clear()
