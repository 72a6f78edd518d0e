"""The evaluator: names, imports, calls, dataclass instances and statements."""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping
from typing import Any

from miles.recipes.pysource.bounds import Bounds, Budget, check_native, check_size
from miles.recipes.pysource.expressions import _EXCEPTIONS, _GETATTR, _HASATTR, BUILTINS, Expressions
from miles.recipes.pysource.values import (
    DataClass,
    Function,
    Instance,
    Module,
    Namespace,
    Native,
    Raised,
    SourceError,
    absolute,
    decorator_name,
    init_false,
)


class _Return(Exception):  # control flow of `return`, not an error
    def __init__(self, value):
        self.value = value


class Evaluator(Expressions):
    """Evaluates functions of `Module`s; `importer(name)` gives the Module or Namespace an
    import statement names (or raises SourceError). A reading runs inside `bounded()`, under
    `bounds` (miles.recipes.pysource.bounds)."""

    def __init__(self, importer: Callable[[str], Module | Namespace], bounds: Bounds | None = None):
        self.importer = importer
        self.bounds = bounds or Bounds()
        self.budget = Budget(self.bounds)

    def bounded(self, what: str):
        """A context for one reading of `what`, under the bounds (Budget.reading)."""
        return self.budget.reading(what)

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
            if not any(decorator_name(d) == "dataclass" for d in node.decorator_list):
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
            dotted = absolute(module, node)
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
            check_native(self.bounds, fn, args, kwargs, where)
            try:
                result = fn(*args, **kwargs)
            except SourceError:
                raise
            except Exception as exc:  # RecursionError and MemoryError of a native's own included
                raise Native(exc) from exc
            owner = getattr(fn, "__self__", None)
            if isinstance(owner, list | dict | set):  # a container a method grew
                check_size(self.bounds, owner, where)
            return check_size(self.bounds, result, where)
        raise SourceError(f"{where}: {fn!r} is not callable here")

    def _call_function(self, fn: Function, args: list, kwargs: dict) -> Any:
        with self.budget.call(f"{fn.module.where(fn.node)}: {fn.name}()"):
            return self._run_function(fn, args, kwargs)

    def _run_function(self, fn: Function, args: list, kwargs: dict) -> Any:
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
        unknown = [k for k in given if k not in fields or init_false(fields[k][0])]
        if unknown:
            raise SourceError(
                f"{cls.module.path}: {cls.node.name} has no settable field(s) {unknown}; "
                f"fields: {', '.join(k for k, (n, _) in fields.items() if not init_false(n))}"
            )
        attrs: dict[str, Any] = {}
        for name, (node, module) in fields.items():
            if name in given:
                attrs[name] = given[name]
            elif node.value is not None and not init_false(node):
                attrs[name] = self._default(module, node)
        instance = Instance(cls, attrs)
        post = cls.method("__post_init__")
        if post is not None:
            self._call_function(Function(post[1], post[0], instance), [], {})
        return instance

    def _default(self, module: Module, node: ast.AnnAssign) -> Any:
        value = node.value
        if isinstance(value, ast.Call) and decorator_name(value.func) == "field":
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
        self.budget.tick(module, node)
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
        except Native as exc:
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
