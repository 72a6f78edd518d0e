"""The bounds a reading runs under, so a crafted launcher ends in one line, never a hang or a crash.

- steps: every expression and statement evaluated is one step (a loop, however it is written,
  runs out of them);
- depth: calls of read functions nested deeper than this (unbounded recursion);
- size: no string, bytes or container the read code makes holds more than `items` elements,
  checked *before* the operations that multiply sizes (repetition, powers, a format width,
  join, replace, re.sub, a container extended by itself) and on every result;
- regular expressions: a pattern with a repetition inside a repetition, or an alternation
  inside one (`(a+)+`, `(a|a)*`: matching time that can grow exponentially) is refused
  before it runs;
- time: `seconds` of wall clock for the whole reading, checked every few thousand steps and,
  on the main thread, by an alarm (a second later) that interrupts a long native call.

Each is a `BoundExceeded` (a SourceError) naming the file and line where it was hit.
"""

from __future__ import annotations

import ast
import re
import signal
import string
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from re import _parser as sre_parse  # the regex parser re itself uses (Python 3.11+)
from typing import Any

from miles.recipes.pysource.values import Module, SourceError


class BoundExceeded(SourceError):
    """The read code went past a bound: it is no launcher's, and is not read further."""


ALARM_GRACE_S = 1.0


class _OutOfTime(BaseException):  # not an Exception: no native's error handling swallows it
    pass


def _alarm(signum, frame) -> None:
    raise _OutOfTime


@dataclass(frozen=True)
class Bounds:
    steps: int = 200_000  # the references' readings take at most 1,467 (measured)
    depth: int = 50  # nested calls of read functions (the references nest 7; Python's own limit is near 70)
    items: int = 1_000_000  # elements of one string, bytes or container
    int_bits: int = 100_000  # bits of one integer the read code computes
    seconds: float = 60.0  # wall clock of one reading


class Budget:
    """What one reading has spent of its bounds: steps, the depth of read calls, the time."""

    def __init__(self, bounds: Bounds):
        self.bounds = bounds
        self.steps = 0
        self.depth = 0
        self.deadline = time.monotonic() + bounds.seconds

    @contextmanager
    def reading(self, what: str) -> Iterator[None]:
        """One reading of `what`: steps and depth from zero, time from now; whatever breaks a
        bound (an alarm in a native call, Python's own recursion or memory limit) ends as one
        BoundExceeded line."""
        self.steps, self.depth = 0, 0
        self.deadline = time.monotonic() + self.bounds.seconds
        alarm = threading.current_thread() is threading.main_thread()
        if alarm:
            previous = signal.signal(signal.SIGALRM, _alarm)
            # later than the steps' own check, which names the line: the alarm is for native calls
            signal.setitimer(signal.ITIMER_REAL, self.bounds.seconds + ALARM_GRACE_S)
        try:
            yield
        except _OutOfTime:
            raise BoundExceeded(
                f"{what}: the reading ran past {self.bounds.seconds:g} s (in a call that does not end); "
                "it is not read further"
            ) from None
        except RecursionError:
            raise BoundExceeded(f"{what}: the read code is nested too deeply to be read") from None
        except MemoryError:
            raise BoundExceeded(f"{what}: the read code asked for more memory than there is") from None
        finally:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)

    def tick(self, module: Module, node: ast.AST) -> None:
        """One step; past the step bound or (checked every few thousand steps) the deadline, stop."""
        self.steps += 1
        if self.steps > self.bounds.steps:
            raise BoundExceeded(
                f"{module.where(node)}: the read code ran past {self.bounds.steps} steps (a loop or "
                "recursion no launcher needs); it is not read further"
            )
        if not self.steps % 4096 and time.monotonic() > self.deadline:
            raise BoundExceeded(
                f"{module.where(node)}: the reading ran past {self.bounds.seconds:g} s; it is not read further"
            )

    @contextmanager
    def call(self, what: str) -> Iterator[None]:
        """A call of a read function, `what`; nested past the depth bound, stop."""
        self.depth += 1
        try:
            if self.depth > self.bounds.depth:
                raise BoundExceeded(
                    f"{what} calls nested {self.bounds.depth} deep (unbounded recursion); it is not read further"
                )
            yield
        finally:
            self.depth -= 1


def sized(value: Any) -> int | None:
    """The number of elements of a string, bytes or container (a range's without building it)."""
    if isinstance(value, str | bytes | bytearray | list | tuple | dict | set | frozenset):
        return len(value)
    if isinstance(value, range):
        try:
            return len(value)
        except OverflowError:
            return 1 << 63
    return None


def check_size(bounds: Bounds, value: Any, where: str) -> Any:
    """`value`, once it is within the size bound."""
    n = sized(value)
    if n is not None and n > bounds.items:
        raise BoundExceeded(f"{where}: a value of {n} elements, over the bound of {bounds.items}")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > bounds.int_bits:
        raise BoundExceeded(
            f"{where}: an integer of {value.bit_length()} bits, over the bound of {bounds.int_bits}"
        )
    return value


def check_binop(bounds: Bounds, op: str, left: Any, right: Any, where: str) -> None:
    """Refuse an operation whose result would pass the bounds, before it is computed."""
    if op == "Pow" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if right * max(abs(left).bit_length() - 1, 1) > bounds.int_bits:
            raise BoundExceeded(f"{where}: {left} ** {right} would pass the bound of {bounds.int_bits} bits")
    if op == "Mult":
        for seq, count in ((left, right), (right, left)):
            n = sized(seq)
            if n is not None and isinstance(count, int) and n * max(count, 0) > bounds.items:
                raise BoundExceeded(
                    f"{where}: repeating {n} elements {count} times would pass the bound of {bounds.items}"
                )
        if isinstance(left, int) and isinstance(right, int):
            if abs(left).bit_length() + abs(right).bit_length() > bounds.int_bits:
                raise BoundExceeded(f"{where}: a product past the bound of {bounds.int_bits} bits")
    if op == "Mod" and isinstance(left, str):
        check_widths(bounds, left, where)


_NUMBER = re.compile(r"\d+")


def check_widths(bounds: Bounds, spec: str, where: str) -> None:
    """A format string or spec whose width or precision would make a string past the bound."""
    for number in _NUMBER.findall(spec):
        if len(number) > 7 or int(number) > bounds.items:
            raise BoundExceeded(f"{where}: a format width of {number}, over the bound of {bounds.items}")


def check_format_string(bounds: Bounds, text: str, where: str) -> None:
    """str.format's fields: each format spec within the bound."""
    try:
        fields = list(string.Formatter().parse(text))
    except ValueError:
        return  # str.format raises it itself, as a native error
    for _, _, spec, _ in fields:
        if spec:
            check_widths(bounds, spec, where)


def check_native(bounds: Bounds, fn: Any, args: list, kwargs: dict, where: str) -> None:
    """Before a native runs: every argument within the size bound, and the natives whose result
    can outgrow their arguments checked for it."""
    for value in [*args, *kwargs.values()]:
        check_size(bounds, value, where)
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", "")
    if isinstance(owner, str) and name == "join" and args:
        parts = list(args[0]) if not isinstance(args[0], str) else list(args[0])
        total = sum(len(p) if isinstance(p, str) else 0 for p in parts) + len(owner) * max(len(parts) - 1, 0)
        if total > bounds.items:
            raise BoundExceeded(
                f"{where}: joining would make a string of {total}, over the bound of {bounds.items}"
            )
    if isinstance(owner, str) and name == "replace" and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        grow = (owner.count(old) if old else len(owner) + 1) * max(len(new) - len(old), 0)
        if len(owner) + grow > bounds.items:
            raise BoundExceeded(f"{where}: replacing would make a string past the bound of {bounds.items}")
    if isinstance(owner, str) and name == "format":
        check_format_string(bounds, owner, where)
    if isinstance(owner, list | dict | set) and name in ("extend", "update") and args:
        n = sized(args[0]) or 0
        if len(owner) + n > bounds.items:
            raise BoundExceeded(f"{where}: growing a container past the bound of {bounds.items}")
    if getattr(fn, "__module__", None) == "re" and args:
        check_pattern(args[0], where)
        if name == "sub" and len(args) >= 3:
            repl, text = args[1], args[2]
            if isinstance(repl, str) and isinstance(text, str) and len(repl) * (len(text) + 1) > bounds.items:
                raise BoundExceeded(f"{where}: re.sub could make a string past the bound of {bounds.items}")


def check_pattern(pattern: Any, where: str) -> None:
    """A regular expression whose matching time stays polynomial: no repetition holding a
    repetition or an alternation."""
    if not isinstance(pattern, str):
        return
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return  # re itself refuses it, as a native error
    if _nested(parsed, inside_repeat=False):
        raise BoundExceeded(
            f"{where}: regular expression {pattern[:60]!r} repeats a repetition or an alternation, whose "
            "matching time can grow exponentially; it is not run"
        )


_REPEATS = {"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"}


def _nested(items, *, inside_repeat: bool) -> bool:
    for op, arg in items:
        name = str(op)
        if name in _REPEATS:
            _, high, sub = arg
            loops = high is sre_parse.MAXREPEAT or high > 1  # `?` and `{n}` are no loop of their own
            if (inside_repeat and loops) or _nested(sub, inside_repeat=inside_repeat or loops):
                return True
        elif name == "BRANCH":
            if inside_repeat:
                return True
            if any(_nested(branch, inside_repeat=False) for branch in arg[1]):
                return True
        elif name == "SUBPATTERN":
            if _nested(arg[-1], inside_repeat=inside_repeat):
                return True
        elif name in ("ASSERT", "ASSERT_NOT"):
            if _nested(arg[1], inside_repeat=inside_repeat):
                return True
    return False
