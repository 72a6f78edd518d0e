"""Rule-based rewards: score one response against its label.

A reward function is `fn(response: str, label: str, metadata: Mapping) -> float` (or a dict
of floats, with `--reward-key` naming the one to train on). Built-ins are looked up by
name; anything else is imported from a dotted path (`package.module.func` or
`package.module:func`), so a project can plug its own rule in without touching miles.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

RewardFn = Callable[[str, str, Mapping[str, Any]], "float | Mapping[str, float]"]


class RewardError(ValueError):
    """A reward spec cannot be resolved, or a reward function returned something unusable."""


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


_LATEX_NOISE = (r"\left", r"\right", r"\!", r"\,", r"\;", r"\ ", "$", r"\displaystyle")
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def normalize_answer(answer: str) -> str:
    """Canonical form of a math answer for exact comparison (spacing, LaTeX noise, 1.0 == 1)."""
    s = answer.strip()
    s = _TEXT_WRAP.sub(r"\1", s)
    for noise in _LATEX_NOISE:
        s = s.replace(noise, "")
    s = (
        s.replace("\\dfrac", "\\frac")
        .replace("\\tfrac", "\\frac")
        .replace("^\\circ", "")
        .replace("^{\\circ}", "")
    )
    s = s.replace(" ", "").rstrip(".")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # 1,000 is a number, (1,2) is a pair
        s = s.replace(",", "")
    number = _as_number(s)
    if number is not None:
        return repr(number)
    return s


def _as_number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        frac = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(\d+)\}", text)
        if not frac or int(frac.group(3)) == 0:
            return None
        value = int(frac.group(2)) / int(frac.group(3)) * (-1 if frac.group(1) else 1)
    if not math.isfinite(value):
        return None
    return float(round(value, 9))


def math_reward(response: str, label: str, metadata: Mapping[str, Any] | None = None) -> float:
    """1.0 when the last `\\boxed{}` of the response equals the label after normalisation."""
    boxed = last_boxed(response)
    if boxed is None:
        return 0.0
    expected = last_boxed(label) or label
    return 1.0 if normalize_answer(boxed) == normalize_answer(expected) else 0.0


def deepscaler_reward(response: str, label: str, metadata: Mapping[str, Any] | None = None) -> float:
    """Math exact match on the text after `</think>`; an unfinished thought scores 0."""
    if "</think>" in response:
        response = response.rsplit("</think>", 1)[1]
    elif "<think>" in response:
        return 0.0
    return math_reward(response, label)


_DAPO_ANSWER = re.compile(r"Answer\s*:\s*(.+)", re.IGNORECASE)


def dapo_reward(response: str, label: str, metadata: Mapping[str, Any] | None = None) -> float:
    """DAPO's rule: the last `Answer: X` line must equal the label; +1 if so, else -1."""
    found = _DAPO_ANSWER.findall(response[-300:])
    if not found:
        return -1.0
    return 1.0 if normalize_answer(found[-1]) == normalize_answer(last_boxed(label) or label) else -1.0


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def gsm8k_reward(response: str, label: str, metadata: Mapping[str, Any] | None = None) -> float:
    """1.0 when the final number of the response equals the label's (`#### 42` or `42`)."""
    expected_text = label.rsplit("####", 1)[-1]
    expected = _NUMBER.findall(expected_text)
    if "####" in response:
        response = response.rsplit("####", 1)[1]
    found = _NUMBER.findall(response)
    if not found or not expected:
        return 0.0
    a, b = (float(x.replace(",", "").rstrip(".")) for x in (found[-1], expected[-1]))
    return 1.0 if math.isclose(a, b, rel_tol=0, abs_tol=1e-9) else 0.0


NEAR_MISS_WIDTH = 64  # code points over which a wrong character still earns some credit


def synthetic_reward(response: str, label: str, metadata: Mapping[str, Any] | None = None) -> float:
    """The synthetic tasks' graded exact match, in [0, 1] and 1.0 only for an exact match.

    Each position up to the longer of response and label earns 1 for the right character,
    up to 0.5 for a near miss (closer code point, less than NEAR_MISS_WIDTH away), 0 for a
    missing or extra character; the score is the mean. A random model over a vocabulary of
    hundreds of tokens almost never hits the exact answer, so the near-miss credit is what
    gives its first rollouts a reward gradient to climb.
    """
    response = response.strip()
    width = max(len(response), len(label))
    if width == 0:
        return 1.0
    credit = 0.0
    for got, want in zip(response, label, strict=False):
        if got == want:
            credit += 1.0
        else:
            credit += 0.5 * max(0.0, 1.0 - abs(ord(got) - ord(want)) / NEAR_MISS_WIDTH)
    return credit / width


BUILTIN: dict[str, RewardFn] = {
    "math": math_reward,
    "deepscaler": deepscaler_reward,
    "dapo": dapo_reward,
    "gsm8k": gsm8k_reward,
    "synthetic": synthetic_reward,
}


def load_reward(spec: str) -> RewardFn:
    """A built-in by name, or a callable imported from `pkg.mod.func` / `pkg.mod:func`."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise RewardError(
            f"reward '{spec}' is neither a built-in ({', '.join(BUILTIN)}) nor a dotted path "
            "like mypkg.rewards.score or mypkg.rewards:score"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(f"reward '{spec}': cannot import module '{module_name}': {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward '{spec}': module '{module_name}' has no callable '{attr}'")
    return fn


FLOAT32_MAX = 3.4028234663852886e38  # rewards become float32 tensors; anything larger is inf there


def score(
    fn: RewardFn,
    response: str,
    label: str,
    metadata: Mapping[str, Any],
    reward_key: str | None,
    *,
    where: str = "",
) -> float:
    """Call a reward function and reduce its result to one float that is finite in float32.

    `where` names the sample (e.g. "prompt 3, sample 5") in the error of a bad value."""
    result = fn(response, label, metadata)
    if isinstance(result, Mapping):
        if reward_key is None or reward_key not in result:
            raise RewardError(
                f"reward function {getattr(fn, '__name__', fn)} returned keys {sorted(result)}; "
                "pass --reward-key with the one to train on"
            )
        result = result[reward_key]
    value = float(result)
    if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        raise RewardError(
            f"reward function {getattr(fn, '__name__', fn)} returned {value} for {where or 'a sample'} "
            f"(label {label!r}): rewards must be finite in float32 (|r| <= {FLOAT32_MAX:.4g}); "
            "fix or rescale the reward function"
        )
    return value
