"""Expressions: how each kind of Python expression is evaluated, and which operations,
builtins and methods of plain values the read code may use."""

from __future__ import annotations

import ast
import builtins
import operator
import re
from typing import Any

from miles.recipes.pysource.bounds import check_binop, check_size, check_widths
from miles.recipes.pysource.values import (
    Function,
    Instance,
    Module,
    Namespace,
    Raised,
    SourceError,
    decorator_name,
)

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


class Expressions:
    """The expression half of the evaluator (miles.recipes.pysource.evaluator.Evaluator)."""

    def expr(self, module: Module, scope: dict, node: ast.expr) -> Any:
        method = getattr(self, f"_e_{type(node).__name__}", None)
        if method is None:
            raise SourceError(f"{module.where(node)}: {type(node).__name__} expressions are not read")
        self.budget.tick(module, node)
        return check_size(self.bounds, method(module, scope, node), module.where(node))

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
        check_widths(self.bounds, str(spec), module.where(node))
        return format(value, spec)

    def _e_BinOp(self, module, scope, node):
        return self._binop(
            module, node, node.op, self.expr(module, scope, node.left), self.expr(module, scope, node.right)
        )

    def _binop(self, module, node, op, left, right):
        fn = _BINOPS.get(type(op))
        if fn is None:
            raise SourceError(f"{module.where(node)}: operator {type(op).__name__} is not read")
        check_binop(self.bounds, type(op).__name__, left, right, module.where(node))
        try:
            return fn(left, right)
        except (TypeError, ZeroDivisionError, OverflowError, ValueError) as exc:
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
            if any(decorator_name(d) == "property" for d in fn_node.decorator_list):
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
