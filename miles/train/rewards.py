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

from miles.train.math_answers import equivalent, exact_number, final_number, last_boxed

RewardFn = Callable[[str, str, Mapping[str, Any]], "float | Mapping[str, float]"]


class RewardError(ValueError):
    """A reward spec cannot be resolved, or a reward function returned something unusable."""


def math_reward(response: str, label: str, metadata: Mapping[str, Any] | None = None) -> float:
    """1.0 when the last `\\boxed{}` of the response is the label's answer (miles.train.math_answers)."""
    boxed = last_boxed(response)
    if boxed is None:
        return 0.0
    return 1.0 if equivalent(boxed, last_boxed(label) or label) else 0.0


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
    return 1.0 if equivalent(found[-1], last_boxed(label) or label) else -1.0


def gsm8k_reward(response: str, label: str, metadata: Mapping[str, Any] | None = None) -> float:
    """1.0 when the final number of the response (after `####` if any) equals the label's
    (`#### 42` or `42`) as an exact number: `1,200` is 1200, `7.0` is 7."""
    found, expected = final_number(response), final_number(label)
    if found is None or expected is None:
        return 0.0
    a, b = (exact_number(x.replace(",", "")) for x in (found, expected))
    return 1.0 if a is not None and a == b else 0.0


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


def scores_samples(fn) -> bool:
    """Whether a reward function scores whole samples (`fn(config, request)`: on-policy
    distillation's asks a teacher about the tokens) rather than a response's text."""
    return bool(getattr(fn, "scores_samples", False))


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
