"""Math answers: where a response states its final answer, and when two answers are the same.

The rewards of miles.train.rewards read a response's answer in the form its dataset asks for
(the last `\\boxed{}` for MATH-style sets and AIME, an `Answer:` line for DAPO, the final
number for GSM8K) and grade it against the label by `equivalent`: equal after normalising the
way answers are written (LaTeX spacing and wrappers, units, `\\dfrac`, `x = 5`, `1,000`,
percent and dollar signs), or equal as exact numbers (`0.5`, `1/2`, `\\frac{1}{2}`), element
by element for tuples and intervals, or with a difference that sympy simplifies to zero
(`2\\sqrt{3}` and `\\sqrt{12}`). As in the seed framework's grader (radixark/miles 31f1ca961,
miles/rollout/rm_hub/math_utils.py, grade_answer_sympy), an integer label takes only an integer
answer, an unreduced fraction must be written as the label writes it, and an expression is
handed to sympy only when it is short and has at most two unknown letters, so grading never
stalls on a pathological response.
"""

from __future__ import annotations

import re
from fractions import Fraction

UNITS = (
    "degrees", "degree", "centimeters", "centimeter", "cm", "meters", "meter", "km", "miles", "mile", "inches",
    "inch", "feet", "foot", "yards", "yard", "seconds", "second", "minutes", "minute", "hours", "hour", "days",
    "day", "weeks", "week", "months", "month", "years", "year", "dollars", "cents", "units", "points",
)  # fmt: skip
_LATEX_NOISE = ("\\$", r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", r"\ ", r"\displaystyle", "$")
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\{([^{}]*)\}")
_UNIT_WORD = re.compile(r"\s*\b(?:" + "|".join(UNITS) + r")\b(\^\d+)?", re.IGNORECASE)
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")
_FRAC_HALF_SHORT = re.compile(r"\\frac(\d)\{")
_SQRT_SHORT = re.compile(r"\\sqrt(\d+)")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_EXACT = re.compile(r"^-?\d+(\.\d+)?$|^-?\.\d+$")
_SLASH = re.compile(r"^(-?\d+)/(\d+)$")
_LATEX_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(\d+)\}$")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
SYMPY_MAX_CHARS = 60  # longer expressions are compared as strings only
SYMPY_MAX_LETTERS = 2  # unknowns an expression may hold for sympy to simplify it


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        # `\boxed 5` (no braces) is valid LaTeX for one token.
        tail = text[start:].split(maxsplit=1)
        return tail[1].split()[0].rstrip("$.") if len(tail) > 1 else None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i]
    return None  # unbalanced: the answer was cut off


def final_number(text: str) -> str | None:
    """The last number written in `text` (`1,200`, `-3.5`), after a `####` marker when present."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    found = _NUMBER.findall(text)
    return found[-1].rstrip(".") if found else None


def normalize(answer: str) -> str:
    """An answer as its canonical string: wrappers, spacing, units and shorthand removed."""
    s = answer.strip().replace("\n", "")
    s = _TEXT_WRAP.sub(r"\1", s)
    for noise in _LATEX_NOISE:
        s = s.replace(noise, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\\\", "\\")
    s = (
        s.replace("^{\\circ}", "")
        .replace("^\\circ", "")
        .replace("\\%", "")
        .replace("%", "")
        .replace("\\$", "")
    )
    s = _UNIT_WORD.sub("", s)
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs.strip()) <= 2:  # "x = 5", "k=3"
        s = rhs
    s = s.replace(" ", "").rstrip(".")
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_HALF_SHORT.sub(r"\\frac{\1}{", s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    if s.startswith("{") and s.endswith("}") and s.count("{") == 1:
        s = s[1:-1]
    if _THOUSANDS.match(s):  # 1,000 is a number, (1,2) is a pair
        s = s.replace(",", "")
    return s


def exact_number(text: str) -> Fraction | None:
    """The exact value of an integer, decimal or fraction (`3`, `-0.25`, `7/2`, `\\frac{7}{2}`)."""
    if _EXACT.match(text):
        return Fraction(text)
    slash = _SLASH.match(text)
    if slash and int(slash.group(2)):
        return Fraction(int(slash.group(1)), int(slash.group(2)))
    frac = _LATEX_FRAC.match(text)
    if frac and int(frac.group(3)):
        value = Fraction(int(frac.group(2)), int(frac.group(3)))
        return -value if frac.group(1) else value
    return None


def _is_integer(text: str) -> bool:
    value = exact_number(text)
    return value is not None and value.denominator == 1 and "/" not in text and "frac" not in text


def _is_fraction(text: str) -> bool:
    return bool(_SLASH.match(text) or _LATEX_FRAC.match(text))


def _elements(text: str) -> tuple[str, list[str]]:
    """A tuple or interval as its brackets and elements; anything else is one element."""
    if len(text) > 2 and text[0] in "([" and text[-1] in ")]" and not any(c in text[1:-1] for c in "()[]"):
        return text[0] + text[-1], text[1:-1].split(",")
    return "", [text]


def equivalent(given: str, truth: str) -> bool:
    """Whether the answer `given` states the label `truth` (see the module docstring)."""
    given, truth = normalize(given), normalize(truth)
    if not given or not truth:
        return False
    if given == truth or given.lower() == truth.lower():
        return True
    given_brackets, given_parts = _elements(given)
    truth_brackets, truth_parts = _elements(truth)
    if given_brackets != truth_brackets or len(given_parts) != len(truth_parts):
        return False
    return all(_same_element(g, t) for g, t in zip(given_parts, truth_parts, strict=True))


def _same_element(given: str, truth: str) -> bool:
    if given == truth:
        return True
    if _is_fraction(given) and _is_fraction(truth):
        return exact_number(given) == exact_number(truth) and _reduced(given) == _reduced(truth)
    if _is_integer(truth) != _is_integer(given):
        return False
    a, b = exact_number(given), exact_number(truth)
    if a is not None and b is not None:
        return a == b
    return _sympy_equal(given, truth)


def _reduced(text: str) -> bool:
    """Whether a fraction is written in lowest terms (an unreduced one must match as written)."""
    numbers = [int(n) for n in re.findall(r"\d+", text)]
    from math import gcd

    return len(numbers) == 2 and gcd(numbers[0], numbers[1]) == 1


_SYMPY_REWRITES = (
    (re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}"), r"((\1)/(\2))"),
    (re.compile(r"\\sqrt\{([^{}]*)\}"), r"sqrt(\1)"),
    (re.compile(r"\\(?:cdot|times)"), "*"),
    (re.compile(r"\\pi"), "pi"),
    (re.compile(r"\^"), "**"),
)


def _sympy_equal(given: str, truth: str) -> bool:
    """The difference of two short expressions simplifies to 0 under sympy."""
    exprs = []
    for text in (given, truth):
        for _ in range(4):  # nested fractions and roots, innermost first
            for pattern, replacement in _SYMPY_REWRITES:
                text = pattern.sub(replacement, text)
        text = text.replace("{", "(").replace("}", ")")
        letters = set(re.findall(r"[a-z]", re.sub(r"sqrt|pi", "", text, flags=re.IGNORECASE)))
        if len(text) > SYMPY_MAX_CHARS or len(letters) > SYMPY_MAX_LETTERS or "\\" in text or "**(" in text:
            return False
        exprs.append(text)
    try:
        from sympy import simplify
        from sympy.parsing.sympy_parser import (
            implicit_multiplication_application,
            parse_expr,
            standard_transformations,
        )

        transforms = (*standard_transformations, implicit_multiplication_application)
        difference = parse_expr(f"({exprs[0]})-({exprs[1]})", transformations=transforms, evaluate=True)
        return bool(simplify(difference) == 0)
    except Exception:  # sympy raises many types (SyntaxError, TypeError, TokenError) on text that is not math
        return False
