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
else is a `SourceError` naming the file and line, never a guess. A reading runs under step,
call-depth, size and time bounds (`Bounds`), so crafted source ends in one line too.
"""

from miles.recipes.pysource.bounds import BoundExceeded, Bounds
from miles.recipes.pysource.evaluator import Evaluator
from miles.recipes.pysource.values import (
    DataClass,
    Function,
    Instance,
    Module,
    Namespace,
    Raised,
    SourceError,
    parse,
)

__all__ = [
    "BoundExceeded",
    "Bounds",
    "DataClass",
    "Evaluator",
    "Function",
    "Instance",
    "Module",
    "Namespace",
    "Raised",
    "SourceError",
    "parse",
]
