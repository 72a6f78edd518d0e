"""Which Transformer Engine the pinned megatron-core supports, as megatron-core itself says.

megatron-core imports Transformer Engine's names inside `try`/`except ImportError` blocks and,
where one is missing, binds a fallback and carries on: with a TE newer than it was built for,
it silently loses TE's router GEMM (`get_workspace`, gone after 2.9) and more. Two facts are
read here:

- the range megatron-core was tested with: its own `Requires-Dist` on transformer-engine
  (`tested_range`, from the installed distribution's metadata; 0.16.1: `>=2.9.0a0,<2.12.0`);
- every TE name it imports (`te_imports`, from its source with `ast`), with the fallback its
  `except` branch binds, resolved against a TE release's own source
  (`python -m miles.image.te_support --wheel transformer_engine-X-py3-none-any.whl` reads the
  wheel and writes `miles/image/facts/transformer-engine-X.toml`, which names the wheel read).

tests/unit/test_transformer_engine_stack.py holds each GPU stack's TE inside the range and
requires every import to resolve in the CUDA stack's release but those in `ACCEPTED_MISSING`.
Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import re
import sys
import tomllib
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

FACTS_DIR = Path(__file__).with_name("facts")
MEGATRON_CORE = "megatron-core"
TE = "transformer_engine"

# Names megatron-core imports that the pinned TE may lack, each with what megatron-core then does.
ACCEPTED_MISSING: Mapping[str, str] = {
    "transformer_engine.pytorch.attention:_SplitAlongDim": (
        "no TE release in megatron-core 0.16.1's tested range exports it there (2.9.0, 2.10.0 and 2.11.0 "
        "define SplitAlongDim in transformer_engine.pytorch.utils only): megatron-core binds SplitAlongDim = "
        "None and its attention splits the fused QKV with torch.split"
    ),
    "transformer_engine.pytorch.tensor.utils:post_all_gather_processing": (
        "read only by megatron-core's own FSDP (megatron_fsdp), which miles never builds: its Megatron backend "
        "wraps the model in megatron-core's DistributedDataParallel"
    ),
}


@dataclass(frozen=True)
class TEImport:
    """One `from transformer_engine... import name` of megatron-core inside a try block."""

    module: str
    name: str
    path: str  # relative to site-packages
    line: int
    fallback: str  # what the except branch binds instead ("" when it binds nothing)
    # "required": in the try's own body; "alternative": under a TE-version branch, or tried in
    # the except branch after another TE name failed (the other path is megatron-core's own)
    role: str = "required"

    @property
    def key(self) -> str:
        return f"{self.module}:{self.name}"


# --- the tested range ---------------------------------------------------------------------

_REQ = re.compile(r"^transformer[-_]engine(?:\[[^\]]*\])?\s*(?P<spec>[^;]*)", re.IGNORECASE)


def tested_range(requires: Iterable[str] | None = None) -> str | None:
    """megatron-core's specifier on transformer-engine (its Requires-Dist, the `dev` extra that
    pins what it is tested with); None when megatron-core is not installed or names none."""
    if requires is None:
        try:
            requires = importlib.metadata.requires(MEGATRON_CORE) or []
        except importlib.metadata.PackageNotFoundError:
            return None
    for line in requires:
        match = _REQ.match(line.strip())
        if match and match["spec"].strip():
            return match["spec"].strip()
    return None


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def _cmp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    width = max(len(a), len(b))
    a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
    return (a > b) - (a < b)


def in_range(version: str, specifier: str) -> bool:
    """Whether `version` meets every clause of `specifier` (release numbers compared; a
    pre-release bound such as >=2.9.0a0 admits 2.9.0)."""
    ops = {"<": lambda c: c < 0, "<=": lambda c: c <= 0, ">": lambda c: c > 0, ">=": lambda c: c >= 0,
           "==": lambda c: c == 0, "!=": lambda c: c != 0}  # fmt: skip
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        match = re.match(r"(<=|>=|==|!=|<|>)\s*(\S+)", clause)
        if match is None or not ops[match[1]](_cmp(_release(version), _release(match[2]))):
            return False
    return True


def range_problem(version: str, where: str, specifier: str | None = None) -> str | None:
    """One line when `version` (stated at `where`) is outside megatron-core's tested range."""
    specifier = specifier if specifier is not None else tested_range()
    if specifier is None or in_range(version, specifier):
        return None
    core = importlib.metadata.version(MEGATRON_CORE)
    return (
        f"transformer-engine {version} ({where}) is outside megatron-core {core}'s tested range {specifier} "
        "(its Requires-Dist): megatron-core falls back to torch where a TE name it imports is gone; pin a "
        "release in the range"
    )


# --- what megatron-core imports --------------------------------------------------------------


def te_imports(megatron_core: Path) -> list[TEImport]:
    """Every TE name megatron-core imports inside a try block, with the except branch's fallback."""
    site = megatron_core.parents[1]
    out: dict[str, TEImport] = {}
    for path in sorted(megatron_core.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except SyntaxError:
            continue
        shown = path.relative_to(site).as_posix()
        handled: set[int] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Try) or id(node) in handled:
                continue
            fallback = "; ".join(
                ast.unparse(s) for h in node.handlers for s in h.body if isinstance(s, ast.Assign)
            )
            for imp, role in _imports_of(node, handled):
                for alias in imp.names:
                    item = TEImport(imp.module or "", alias.name, shown, imp.lineno, fallback, role)
                    out.setdefault(item.key, item)
    return sorted(out.values(), key=lambda i: i.key)


def _imports_of(node: ast.Try, handled: set[int]) -> list[tuple[ast.ImportFrom, str]]:
    """(TE import, role) of a try block: its body's are required unless a TE-version branch holds
    them; those its except branches try instead (nested trys, marked handled) are alternatives."""
    found: list[tuple[ast.ImportFrom, str]] = []

    def visit(stmts: list[ast.stmt], role: str) -> None:
        for stmt in stmts:
            if (
                isinstance(stmt, ast.ImportFrom)
                and (stmt.module or "").split(".")[0] == TE
                and not stmt.level
            ):
                found.append((stmt, role))
            elif isinstance(stmt, ast.If):
                versioned = "te_min_version" in ast.unparse(stmt.test) or "te_version" in ast.unparse(
                    stmt.test
                )
                visit(stmt.body, "alternative" if versioned else role)
                visit(stmt.orelse, "alternative" if versioned else role)
            elif isinstance(stmt, ast.Try):
                handled.add(id(stmt))
                visit(stmt.body, role)
                for handler in stmt.handlers:
                    visit(handler.body, "alternative")

    visit(node.body, "required")
    alternatives = any(
        isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == TE
        for h in node.handlers
        for n in ast.walk(ast.Module(h.body, []))
    )
    for handler in node.handlers:
        visit(handler.body, "alternative")
    if alternatives:  # the body's names have a fallback import of TE's own
        found = [(imp, "alternative") for imp, _ in found]
    return found


# --- a TE release's own source -----------------------------------------------------------------


def _defined(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        else:
            names |= {
                n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            }
    return names


def resolve(wheel: Path, imports: Iterable[TEImport]) -> dict[str, str | None]:
    """key -> "file:line" where the wheel's source defines the name (a submodule, or a name a
    `from .x import *` brings, counts), or None."""
    with zipfile.ZipFile(wheel) as zf:
        files = {n for n in zf.namelist() if n.endswith(".py")}
        trees: dict[str, ast.Module] = {}

        def module_file(base: str) -> str | None:
            return next((f for f in (f"{base}.py", f"{base}/__init__.py") if f in files), None)

        def defines(base: str, name: str, depth: int = 0) -> str | None:
            found = module_file(base)
            if found is None or depth > 3:
                return None
            if module_file(f"{base}/{name}"):
                return module_file(f"{base}/{name}")
            tree = trees.setdefault(found, ast.parse(zf.read(found).decode("utf-8")))
            for node in tree.body:
                if name in _defined(ast.Module([node], [])):
                    return f"{found}:{node.lineno}"
            package = base if found.endswith("__init__.py") else base.rpartition("/")[0]
            for node in tree.body:  # `from .x import *`
                if isinstance(node, ast.ImportFrom) and node.level == 1 and node.names[0].name == "*":
                    hit = defines(f"{package}/{(node.module or '').replace('.', '/')}", name, depth + 1)
                    if hit:
                        return hit
            return None

        return {item.key: defines(item.module.replace(".", "/"), item.name) for item in imports}


def installed_megatron_core() -> Path:
    """The installed megatron-core's `megatron/core` folder, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("megatron-core is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "core"


def facts_path(version: str) -> Path:
    return FACTS_DIR / f"transformer-engine-{version}.toml"


def load_facts(version: str) -> dict:
    """The facts file of a TE release: {"source": ..., "resolved": {key: where}, "missing": {key: fallback}}."""
    with open(facts_path(version), "rb") as fh:
        return tomllib.load(fh)


def _missing_text(item: TEImport) -> str:
    return f"{item.role}; {item.path}:{item.line}: {item.fallback or 'binds nothing'}"


def unsupported(version: str, imports: Iterable[TEImport]) -> list[str]:
    """The required imports the release's facts say are missing and ACCEPTED_MISSING does not
    explain; raises FileNotFoundError without a facts file for the release."""
    facts = load_facts(version)
    missing = facts.get("missing", {})
    return [
        f"{i.key} ({i.path}:{i.line}): missing in transformer-engine {version}, so megatron-core falls back "
        f"({i.fallback or 'binds nothing'})"
        for i in imports
        if i.role == "required" and i.key in missing and i.key not in ACCEPTED_MISSING
    ]


def facts_text(
    version: str, wheel_name: str, imports: list[TEImport], found: Mapping[str, str | None]
) -> str:
    from importlib.metadata import version as dist_version

    q = lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'  # noqa: E731
    lines = [
        f"# megatron-core {dist_version(MEGATRON_CORE)}'s imports of Transformer Engine (miles.image.te_support."
        "te_imports)",
        f"# resolved against transformer-engine {version}'s own source. Written by `python -m "
        "miles.image.te_support --wheel ...`.",
        f"source = {q(f'PyPI {wheel_name}')}",
        f"version = {q(version)}",
        "",
        "[resolved]",
        *(f"{q(i.key)} = {q(found[i.key] or '')}" for i in imports if found[i.key]),
        "",
        "# missing in this release: what megatron-core's except branch binds instead",
        "[missing]",
        *(f"{q(i.key)} = {q(_missing_text(i))}" for i in imports if not found[i.key]),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m miles.image.te_support", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--wheel", type=Path, required=True, help="a transformer_engine-X-py3-none-any.whl")
    args = parser.parse_args(argv)
    match = re.match(r"transformer_engine-([^-]+)-", args.wheel.name)
    if match is None:
        print(f"error: {args.wheel.name} is not a transformer_engine wheel", file=sys.stderr)
        return 2
    imports = te_imports(installed_megatron_core())
    found = resolve(args.wheel, imports)
    FACTS_DIR.mkdir(exist_ok=True)
    path = facts_path(match[1])
    path.write_text(facts_text(match[1], args.wheel.name, imports, found))
    missing = [k for k, v in found.items() if v is None]
    print(f"wrote {path}: {len(found) - len(missing)} resolved, {len(missing)} missing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
