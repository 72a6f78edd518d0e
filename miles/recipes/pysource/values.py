"""What the evaluator works with: read files, their functions and dataclasses, instances,
modelled namespaces, and the errors it raises."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class SourceError(ValueError):
    """The source uses something the evaluator does not support, or refuses the inputs."""


class Raised(SourceError):
    """The read code raised (an assert, a `raise`, a failed lookup): it refuses these inputs."""


class Native(Raised):
    """An error a native raised; `try` blocks in the read code can catch it."""

    def __init__(self, error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


@dataclass
class Module:
    """One read file: its top-level definitions, evaluated on first use."""

    path: str
    tree: ast.Module
    natives: dict[str, Any] = field(default_factory=dict)  # names modelled instead of read
    values: dict[str, Any] = field(default_factory=dict)
    defs: dict[str, ast.stmt] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for node in self.tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                self.defs[node.name] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for name in _names(target):
                        self.defs[name] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                self.defs[node.target.id] = node
            elif isinstance(node, ast.Import | ast.ImportFrom):
                for alias in node.names:
                    self.defs[alias.asname or alias.name.split(".")[0]] = node

    def where(self, node: ast.AST) -> str:
        return f"{self.path}:{getattr(node, 'lineno', '?')}"


def _names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple | ast.List):
        return [n for elt in target.elts for n in _names(elt)]
    return []


@dataclass
class Function:
    module: Module
    node: ast.FunctionDef | ast.Lambda
    bound: Any = None  # `self` of a method

    @property
    def name(self) -> str:
        return getattr(self.node, "name", "<lambda>")


@dataclass
class DataClass:
    """A `@dataclass` read from source: its fields in order (bases first) and its methods."""

    module: Module
    node: ast.ClassDef
    bases: tuple[DataClass, ...]

    def fields(self) -> list[tuple[str, ast.AnnAssign, Module]]:
        out: dict[str, tuple[str, ast.AnnAssign, Module]] = {}
        for base in self.bases:
            for name, node, module in base.fields():
                out[name] = (name, node, module)
        for node in self.node.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out[node.target.id] = (node.target.id, node, self.module)
        return list(out.values())

    def method(self, name: str) -> tuple[ast.FunctionDef, Module] | None:
        for node in self.node.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node, self.module
        for base in self.bases:
            found = base.method(name)
            if found:
                return found
        return None


@dataclass
class Instance:
    cls: DataClass
    attrs: dict[str, Any]


@dataclass
class Namespace:
    """A modelled module or object: attributes are natives, nothing else."""

    name: str
    attrs: Mapping[str, Any]


def absolute(module: Module, node: ast.ImportFrom) -> str:
    """The dotted name a `from ... import` names, relative imports resolved against the file."""
    if not node.level:
        return node.module or ""
    package = module.path.removesuffix(".py").split("/")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def init_false(node: ast.AnnAssign) -> bool:
    value = node.value
    return (
        isinstance(value, ast.Call)
        and decorator_name(value.func) == "field"
        and any(
            k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
            for k in value.keywords
        )
    )


def decorator_name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def parse(path: str, text: str, natives: Mapping[str, Any] | None = None) -> Module:
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as exc:
        raise SourceError(f"{path}:{exc.lineno}: not Python: {exc.msg}") from None
    except (RecursionError, MemoryError, ValueError) as exc:  # nested past the parser, NUL bytes
        raise SourceError(f"{path}: not Python this reader can parse ({type(exc).__name__})") from None
    return Module(path, tree, dict(natives or {}))
