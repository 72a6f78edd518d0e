"""Evaluate a small, declared subset of Python over source text, as data: nothing is imported
or executed, and only the operations below can happen.

The seed framework's launchers build their trainer command from f-strings, conditionals,
`match` statements and dataclass fields; `miles.recipes.upstream` reads that command from
the source at a commit with this evaluator. What it supports: literals, f-strings, names,
arithmetic, comparisons, boolean logic, conditional expressions, comprehensions, walrus,
calls of functions and lambdas defined in the read files, dataclass instances with
defaults, `__post_init__` and properties, assignments, `if`, `match`, `for`, `try`,
`assert`, `raise`, `return`. Calls leave the read files only for the natives it is given
(modelled library functions, whitelisted builtins and methods of plain values). Anything
else is a `SourceError` naming the file and line, never a guess.
"""

from __future__ import annotations

import ast
import builtins
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class SourceError(ValueError):
    """The source uses something the evaluator does not support, or refuses the inputs."""


class Raised(SourceError):
    """The read code raised (an assert, a `raise`, a failed lookup): it refuses these inputs."""


_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.BitOr: operator.or_,
}  # fmt: skip
_COMPARE = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_, ast.IsNot: operator.is_not,
}  # fmt: skip
# Methods of plain values the read code may call (no attribute starting with "_", ever).
_METHODS = {
    str: {"split", "strip", "lstrip", "rstrip", "join", "replace", "startswith", "endswith", "lower", "upper",
          "format", "removeprefix", "removesuffix", "partition", "encode", "count", "find", "isdigit"},
    bytes: {"decode"},
    dict: {"get", "items", "keys", "values", "setdefault", "update", "copy", "pop"},
    list: {"append", "extend", "index", "count", "copy"},
    tuple: {"index", "count"},
    set: {"add", "update"},
}  # fmt: skip
_EXCEPTIONS = {
    name: cls for name, cls in vars(builtins).items() if isinstance(cls, type) and issubclass(cls, Exception)
}
BUILTINS: dict[str, Any] = {
    "int": int, "str": str, "float": float, "bool": bool, "min": min, "max": max, "len": len, "sum": sum,
    "any": any, "all": all, "abs": abs, "round": round, "sorted": sorted, "list": list, "dict": dict,
    "tuple": tuple, "set": set, "range": range, "enumerate": enumerate, "zip": zip, "isinstance": isinstance,
    "print": lambda *a, **k: None, "True": True, "False": False, "None": None,
}  # fmt: skip
_GETATTR, _HASATTR = object(), object()  # need the evaluator's attribute rules: handled in call()
BUILTINS |= {"getattr": _GETATTR, "hasattr": _HASATTR}
_METHODS[re.Match] = {"group", "groups"}


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


class _Return(Exception):  # control flow of `return`, not an error
    def __init__(self, value):
        self.value = value


class Evaluator:
    """Evaluates functions of `Module`s; `importer(name)` gives the Module or Namespace an
    import statement names (or raises SourceError)."""

    def __init__(self, importer: Callable[[str], Module | Namespace]):
        self.importer = importer

    # --- names ---------------------------------------------------------------------------

    def lookup(self, module: Module, name: str, node: ast.AST) -> Any:
        if name in module.natives:
            return module.natives[name]
        if name in module.values:
            return module.values[name]
        if name in module.defs:
            module.values[name] = self._define(module, name, module.defs[name])
            return module.values[name]
        if name == "__file__":
            return module.path
        if name in BUILTINS:
            return BUILTINS[name]
        if name in _EXCEPTIONS:
            return _EXCEPTIONS[name]
        raise SourceError(f"{module.where(node)}: name {name!r} is not defined in the read source")

    def _define(self, module: Module, name: str, node: ast.stmt) -> Any:
        if isinstance(node, ast.FunctionDef):
            return Function(module, node)
        if isinstance(node, ast.ClassDef):
            if not any(_decorator_name(d) == "dataclass" for d in node.decorator_list):
                raise SourceError(
                    f"{module.where(node)}: class {name} is not a @dataclass; only those are read"
                )
            bases = tuple(self.expr(module, {}, b) for b in node.bases)
            bad = [b for b in bases if not isinstance(b, DataClass)]
            if bad:
                raise SourceError(
                    f"{module.where(node)}: class {name} derives from something not read as a dataclass"
                )
            return DataClass(module, node, bases)
        if isinstance(node, ast.Import | ast.ImportFrom):
            return self._import(module, name, node)
        value = self.expr(module, {}, node.value)
        if isinstance(node, ast.Assign) and not isinstance(node.targets[0], ast.Name):
            scope: dict[str, Any] = {}
            self._assign(module, scope, node.targets[0], value)
            return scope[name]
        return value

    def _import(self, module: Module, name: str, node: ast.Import | ast.ImportFrom) -> Any:
        for alias in node.names:
            if (alias.asname or alias.name.split(".")[0]) != name:
                continue
            if isinstance(node, ast.Import):
                return self.importer(alias.name if alias.asname else alias.name.split(".")[0])
            dotted = _absolute(module, node)
            source = self.importer(dotted)
            if isinstance(source, Module):
                if alias.name not in source.defs and alias.name not in source.natives:
                    return self.importer(f"{dotted}.{alias.name}")  # a submodule of the package
                return self.lookup(source, alias.name, node)
            if alias.name not in source.attrs:
                raise SourceError(f"{module.where(node)}: {node.module}.{alias.name} is not modelled")
            return source.attrs[alias.name]
        raise SourceError(f"{module.where(node)}: import of {name} not found")

    # --- calls ---------------------------------------------------------------------------

    def call(self, fn: Any, args: list, kwargs: dict, where: str = "") -> Any:
        if fn is _GETATTR or fn is _HASATTR:
            try:
                value = self.attribute(args[0], args[1], where)
            except Raised:
                if fn is _HASATTR:
                    return False
                if len(args) < 3:
                    raise
                return args[2]
            return True if fn is _HASATTR else value
        if isinstance(fn, Function):
            return self._call_function(fn, args, kwargs)
        if isinstance(fn, DataClass):
            return self.instantiate(fn, dict(zip([f for f, *_ in fn.fields()], args, strict=False)) | kwargs)
        if isinstance(fn, type) and issubclass(fn, Exception):
            return fn(*args)
        if callable(fn) and not isinstance(fn, Module | Namespace | Instance):
            try:
                return fn(*args, **kwargs)
            except SourceError:
                raise
            except Exception as exc:
                raise _Native(exc) from exc
        raise SourceError(f"{where}: {fn!r} is not callable here")

    def _call_function(self, fn: Function, args: list, kwargs: dict) -> Any:
        node, module = fn.node, fn.module
        params = node.args
        scope: dict[str, Any] = {}
        positional = [a.arg for a in (*params.posonlyargs, *params.args)]
        given = ([fn.bound] if fn.bound is not None else []) + list(args)
        if len(given) > len(positional) and params.vararg is None:
            raise SourceError(
                f"{module.where(node)}: {fn.name}() takes {len(positional)} positional arguments"
            )
        scope.update(zip(positional, given, strict=False))
        if params.vararg is not None:
            scope[params.vararg.arg] = tuple(given[len(positional) :])
        extra = {}
        for key, value in kwargs.items():
            if key in positional or key in [a.arg for a in params.kwonlyargs]:
                scope[key] = value
            elif params.kwarg is not None:
                extra[key] = value
            else:
                raise SourceError(f"{module.where(node)}: {fn.name}() has no parameter {key!r}")
        if params.kwarg is not None:
            scope[params.kwarg.arg] = extra
        defaults = dict(
            zip(positional[len(positional) - len(params.defaults) :], params.defaults, strict=True)
        )
        defaults |= {
            a.arg: d for a, d in zip(params.kwonlyargs, params.kw_defaults, strict=True) if d is not None
        }
        for name in [*positional, *(a.arg for a in params.kwonlyargs)]:
            if name not in scope:
                if name not in defaults:
                    raise SourceError(f"{module.where(node)}: {fn.name}() missing argument {name!r}")
                scope[name] = self.expr(module, {}, defaults[name])
        if isinstance(node, ast.Lambda):
            return self.expr(module, scope, node.body)
        try:
            self.block(module, scope, node.body)
        except _Return as ret:
            return ret.value
        return None

    def instantiate(self, cls: DataClass, given: Mapping[str, Any]) -> Instance:
        """A dataclass instance: given values, then defaults (default_factory called), then
        __post_init__; a field with init=False starts unset."""
        fields = {name: (node, module) for name, node, module in cls.fields()}
        unknown = [k for k in given if k not in fields or _init_false(fields[k][0])]
        if unknown:
            raise SourceError(
                f"{cls.module.path}: {cls.node.name} has no settable field(s) {unknown}; "
                f"fields: {', '.join(k for k, (n, _) in fields.items() if not _init_false(n))}"
            )
        attrs: dict[str, Any] = {}
        for name, (node, module) in fields.items():
            if name in given:
                attrs[name] = given[name]
            elif node.value is not None and not _init_false(node):
                attrs[name] = self._default(module, node)
        instance = Instance(cls, attrs)
        post = cls.method("__post_init__")
        if post is not None:
            self._call_function(Function(post[1], post[0], instance), [], {})
        return instance

    def _default(self, module: Module, node: ast.AnnAssign) -> Any:
        value = node.value
        if isinstance(value, ast.Call) and _decorator_name(value.func) == "field":
            kw = {k.arg: k.value for k in value.keywords}
            if "default_factory" in kw:
                return self.call(self.expr(module, {}, kw["default_factory"]), [], {}, module.where(node))
            if "default" in kw:
                return self.expr(module, {}, kw["default"])
            raise SourceError(f"{module.where(node)}: field() without a default")
        return self.expr(module, {}, value)

    # --- statements ----------------------------------------------------------------------

    def block(self, module: Module, scope: dict, body: list[ast.stmt]) -> None:
        for stmt in body:
            self.stmt(module, scope, stmt)

    def stmt(self, module: Module, scope: dict, node: ast.stmt) -> None:
        if isinstance(node, ast.Expr):
            if not isinstance(node.value, ast.Constant):  # docstrings
                self.expr(module, scope, node.value)
        elif isinstance(node, ast.Assign):
            value = self.expr(module, scope, node.value)
            for target in node.targets:
                self._assign(module, scope, target, value)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self._assign(module, scope, node.target, self.expr(module, scope, node.value))
        elif isinstance(node, ast.AugAssign):
            current = self.expr(module, scope, _load(node.target))
            value = self._binop(module, node, node.op, current, self.expr(module, scope, node.value))
            self._assign(module, scope, node.target, value)
        elif isinstance(node, ast.If):
            branch = node.body if self.expr(module, scope, node.test) else node.orelse
            self.block(module, scope, branch)
        elif isinstance(node, ast.Match):
            self._match(module, scope, node)
        elif isinstance(node, ast.For):
            for item in self.expr(module, scope, node.iter):
                self._assign(module, scope, node.target, item)
                self.block(module, scope, node.body)
        elif isinstance(node, ast.Return):
            raise _Return(None if node.value is None else self.expr(module, scope, node.value))
        elif isinstance(node, ast.Assert):
            if not self.expr(module, scope, node.test):
                msg = "" if node.msg is None else f": {self.expr(module, scope, node.msg)}"
                raise Raised(f"{module.where(node)}: assertion failed{msg}")
        elif isinstance(node, ast.Raise):
            exc = None if node.exc is None else self.expr(module, scope, node.exc)
            raise Raised(f"{module.where(node)}: the script raises {exc!r}")
        elif isinstance(node, ast.Try):
            self._try(module, scope, node)
        elif isinstance(node, ast.Pass):
            pass
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                scope[name] = self._import(module, name, node)
        else:
            raise SourceError(f"{module.where(node)}: {type(node).__name__} statements are not read")

    def _try(self, module: Module, scope: dict, node: ast.Try) -> None:
        try:
            self.block(module, scope, node.body)
        except _Native as exc:
            for handler in node.handlers:
                kinds = self.expr(module, scope, handler.type) if handler.type is not None else Exception
                if isinstance(exc.error, kinds):
                    self.block(module, scope, handler.body)
                    break
            else:
                raise
        else:
            self.block(module, scope, node.orelse)
        self.block(module, scope, node.finalbody)

    def _match(self, module: Module, scope: dict, node: ast.Match) -> None:
        subject = self.expr(module, scope, node.subject)
        for case in node.cases:
            if self._pattern(module, scope, case.pattern, subject) and (
                case.guard is None or self.expr(module, scope, case.guard)
            ):
                self.block(module, scope, case.body)
                return

    def _pattern(self, module: Module, scope: dict, pattern: ast.pattern, subject: Any) -> bool:
        if isinstance(pattern, ast.MatchValue):
            return subject == self.expr(module, scope, pattern.value)
        if isinstance(pattern, ast.MatchSingleton):
            return subject is pattern.value
        if isinstance(pattern, ast.MatchOr):
            return any(self._pattern(module, scope, p, subject) for p in pattern.patterns)
        if isinstance(pattern, ast.MatchAs):
            if pattern.pattern is not None and not self._pattern(module, scope, pattern.pattern, subject):
                return False
            if pattern.name is not None:
                scope[pattern.name] = subject
            return True
        if isinstance(pattern, ast.MatchSequence):
            if not isinstance(subject, list | tuple) or len(subject) != len(pattern.patterns):
                return False
            return all(
                self._pattern(module, scope, p, s) for p, s in zip(pattern.patterns, subject, strict=True)
            )
        raise SourceError(f"{module.where(pattern)}: {type(pattern).__name__} patterns are not read")

    def _assign(self, module: Module, scope: dict, target: ast.expr, value: Any) -> None:
        if isinstance(target, ast.Name):
            scope[target.id] = value
        elif isinstance(target, ast.Tuple | ast.List):
            values = list(value)
            if len(values) != len(target.elts):
                raise Raised(
                    f"{module.where(target)}: cannot unpack {len(values)} values into {len(target.elts)}"
                )
            for elt, item in zip(target.elts, values, strict=True):
                self._assign(module, scope, elt, item)
        elif isinstance(target, ast.Attribute):
            owner = self.expr(module, scope, target.value)
            if not isinstance(owner, Instance):
                raise SourceError(f"{module.where(target)}: only dataclass fields are assigned as attributes")
            owner.attrs[target.attr] = value
        elif isinstance(target, ast.Subscript):
            owner = self.expr(module, scope, target.value)
            key = self.expr(module, scope, target.slice)
            if isinstance(owner, Namespace) and "__setitem__" in owner.attrs:
                owner.attrs["__setitem__"](key, value)
            elif isinstance(owner, dict | list):
                owner[key] = value
            else:
                raise SourceError(f"{module.where(target)}: cannot assign an item of {type(owner).__name__}")
        else:
            raise SourceError(f"{module.where(target)}: cannot assign to {type(target).__name__}")

    # --- expressions ---------------------------------------------------------------------

    def expr(self, module: Module, scope: dict, node: ast.expr) -> Any:
        method = getattr(self, f"_e_{type(node).__name__}", None)
        if method is None:
            raise SourceError(f"{module.where(node)}: {type(node).__name__} expressions are not read")
        return method(module, scope, node)

    def _e_Constant(self, module, scope, node):
        return node.value

    def _e_Name(self, module, scope, node):
        return scope[node.id] if node.id in scope else self.lookup(module, node.id, node)

    def _e_JoinedStr(self, module, scope, node):
        return "".join(str(self.expr(module, scope, v)) for v in node.values)

    def _e_FormattedValue(self, module, scope, node):
        value = self.expr(module, scope, node.value)
        if node.conversion == ord("r"):
            value = repr(value)
        elif node.conversion == ord("s"):
            value = str(value)
        spec = "" if node.format_spec is None else self.expr(module, scope, node.format_spec)
        return format(value, spec)

    def _e_BinOp(self, module, scope, node):
        return self._binop(
            module, node, node.op, self.expr(module, scope, node.left), self.expr(module, scope, node.right)
        )

    def _binop(self, module, node, op, left, right):
        fn = _BINOPS.get(type(op))
        if fn is None:
            raise SourceError(f"{module.where(node)}: operator {type(op).__name__} is not read")
        try:
            return fn(left, right)
        except (TypeError, ZeroDivisionError) as exc:
            raise Raised(f"{module.where(node)}: {exc}") from exc

    def _e_UnaryOp(self, module, scope, node):
        value = self.expr(module, scope, node.operand)
        if isinstance(node.op, ast.Not):
            return not value
        if isinstance(node.op, ast.USub):
            return -value
        if isinstance(node.op, ast.UAdd):
            return +value
        raise SourceError(f"{module.where(node)}: operator {type(node.op).__name__} is not read")

    def _e_BoolOp(self, module, scope, node):
        value = None
        for operand in node.values:
            value = self.expr(module, scope, operand)
            if isinstance(node.op, ast.And) and not value:
                return value
            if isinstance(node.op, ast.Or) and value:
                return value
        return value

    def _e_Compare(self, module, scope, node):
        left = self.expr(module, scope, node.left)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = self.expr(module, scope, right_node)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True

    def _e_IfExp(self, module, scope, node):
        branch = node.body if self.expr(module, scope, node.test) else node.orelse
        return self.expr(module, scope, branch)

    def _e_NamedExpr(self, module, scope, node):
        value = self.expr(module, scope, node.value)
        scope[node.target.id] = value
        return value

    def _e_Dict(self, module, scope, node):
        out = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if key is None:
                out.update(self.expr(module, scope, value))
            else:
                out[self.expr(module, scope, key)] = self.expr(module, scope, value)
        return out

    def _e_List(self, module, scope, node):
        return [x for elt in node.elts for x in self._elements(module, scope, elt)]

    def _e_Tuple(self, module, scope, node):
        return tuple(x for elt in node.elts for x in self._elements(module, scope, elt))

    def _e_Set(self, module, scope, node):
        return {x for elt in node.elts for x in self._elements(module, scope, elt)}

    def _elements(self, module, scope, elt):
        if isinstance(elt, ast.Starred):
            return list(self.expr(module, scope, elt.value))
        return [self.expr(module, scope, elt)]

    def _e_Lambda(self, module, scope, node):
        if scope:
            raise SourceError(f"{module.where(node)}: a lambda that closes over locals is not read")
        return Function(module, node)

    def _comprehension(self, module, scope, generators, emit):
        def walk(index: int, inner: dict):
            if index == len(generators):
                emit(inner)
                return
            gen = generators[index]
            for item in self.expr(module, inner, gen.iter):
                local = dict(inner)
                self._assign(module, local, gen.target, item)
                if all(self.expr(module, local, cond) for cond in gen.ifs):
                    walk(index + 1, local)

        walk(0, dict(scope))

    def _e_ListComp(self, module, scope, node):
        out: list = []
        self._comprehension(
            module, scope, node.generators, lambda s: out.append(self.expr(module, s, node.elt))
        )
        return out

    _e_GeneratorExp = _e_ListComp

    def _e_SetComp(self, module, scope, node):
        return set(self._e_ListComp(module, scope, node))

    def _e_DictComp(self, module, scope, node):
        out: dict = {}

        def emit(s):
            out[self.expr(module, s, node.key)] = self.expr(module, s, node.value)

        self._comprehension(module, scope, node.generators, emit)
        return out

    def _e_Subscript(self, module, scope, node):
        owner = self.expr(module, scope, node.value)
        if isinstance(node.slice, ast.Slice):
            parts = [
                None if p is None else self.expr(module, scope, p)
                for p in (node.slice.lower, node.slice.upper, node.slice.step)
            ]
            key: Any = slice(*parts)
        else:
            key = self.expr(module, scope, node.slice)
        if isinstance(owner, Namespace):
            getter = owner.attrs.get("__getitem__")
            if getter is None:
                raise SourceError(f"{module.where(node)}: {owner.name} is not subscriptable")
            return self.call(getter, [key], {}, module.where(node))
        try:
            return owner[key]
        except (KeyError, IndexError, TypeError) as exc:
            raise Raised(f"{module.where(node)}: lookup {key!r} failed ({type(exc).__name__})") from exc

    def _e_Attribute(self, module, scope, node):
        owner = self.expr(module, scope, node.value)
        return self.attribute(owner, node.attr, module.where(node))

    def attribute(self, owner: Any, name: str, where: str) -> Any:
        if isinstance(owner, Instance):
            if name in owner.attrs:
                return owner.attrs[name]
            found = owner.cls.method(name)
            if found is None:
                raise Raised(f"{where}: {owner.cls.node.name} has no attribute {name!r} (an unset field?)")
            fn_node, fn_module = found
            fn = Function(fn_module, fn_node, owner)
            if any(_decorator_name(d) == "property" for d in fn_node.decorator_list):
                return self._call_function(fn, [], {})
            return fn
        if isinstance(owner, Module):
            return self.lookup(owner, name, ast.Name(name))
        if isinstance(owner, Namespace):
            if name not in owner.attrs:
                raise SourceError(f"{where}: {owner.name}.{name} is not modelled")
            return owner.attrs[name]
        if name.startswith("_"):
            raise SourceError(f"{where}: attribute {name!r} is not read")
        if owner is dict and name == "fromkeys":
            return dict.fromkeys
        for kind, names in _METHODS.items():
            if isinstance(owner, kind) and name in names:
                return getattr(owner, name)
        allowed = getattr(type(owner), "PUBLIC", ())
        if name in allowed:
            return getattr(owner, name)
        raise SourceError(f"{where}: {type(owner).__name__}.{name} is not read")

    def _e_Call(self, module, scope, node):
        fn = self.expr(module, scope, node.func)
        args: list = []
        for arg in node.args:
            args += self._elements(module, scope, arg)
        kwargs: dict = {}
        for kw in node.keywords:
            value = self.expr(module, scope, kw.value)
            if kw.arg is None:
                kwargs.update(value)
            else:
                kwargs[kw.arg] = value
        return self.call(fn, args, kwargs, module.where(node))


class _Native(Raised):
    """An error a native raised; `try` blocks in the read code can catch it."""

    def __init__(self, error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


def _load(target: ast.expr) -> ast.expr:
    """An assignment target as the expression that reads it."""
    if isinstance(target, ast.Name):
        node: ast.expr = ast.Name(target.id, ast.Load())
    elif isinstance(target, ast.Attribute):
        node = ast.Attribute(target.value, target.attr, ast.Load())
    elif isinstance(target, ast.Subscript):
        node = ast.Subscript(target.value, target.slice, ast.Load())
    else:
        return target
    return ast.copy_location(node, target)


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    """The dotted name a `from ... import` names, relative imports resolved against the file."""
    if not node.level:
        return node.module or ""
    package = module.path.removesuffix(".py").split("/")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def _init_false(node: ast.AnnAssign) -> bool:
    value = node.value
    return (
        isinstance(value, ast.Call)
        and _decorator_name(value.func) == "field"
        and any(
            k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
            for k in value.keywords
        )
    )


def _decorator_name(node: ast.expr) -> str:
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
    return Module(path, tree, dict(natives or {}))
