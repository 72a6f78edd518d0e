"""On-policy distillation (`--use-opd --opd-type sglang`): a teacher scores the policy's own samples.

Each sample (prompt and response token ids) is sent to the teacher at `--rm-url`, a server that
speaks SGLang's `/generate` scoring request (`max_new_tokens` 0, `return_logprob`,
`logprob_start_len` 0, optionally `top_logprobs_num` and `token_ids_logprob`): SGLang on GPUs
(`python -m sglang.launch_server`), miles' own `python -m miles.rollout.teacher_server` on a
machine without one. The per-token signal is the seed framework's reverse KL
(radixark/miles 31f1ca961, miles/rollout/on_policy_distillation.py and
miles/backends/training_utils/loss_hub/opd.py):

- `--opd-log-prob-top-k 0`: log pi(y_t) - log pi_teacher(y_t) of each sampled token y_t;
- `--opd-log-prob-top-k k`: over a token set per position (`--opd-top-k-strategy`: the student's
  top k, `only-student`, or those also in the teacher's top k, `intersection`), sum_i w_i
  (log pi(i) - log pi_teacher(i)), the weights the policy's probabilities renormalised over the
  set (`--opd-reward-weight-mode student_p`), the teacher's (`teacher_p`) or uniform (`none`).

The policy's log-probabilities are the rollout engine's (the seed takes the trainer's, which
agree with them to the precision `--ci-logprob-abs-diff-tol` checks). Training subtracts
`--opd-kl-coef` times the per-token reverse KL from each token's advantage; the samples' scalar
rewards are 0, so the teacher's signal is the whole of it (as in the seed). `rollout/opd_reverse_kl`
logs the mean over the rollout's response tokens: the policy's KL to the teacher, estimated on
its own samples.
"""

from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

STRATEGIES = ("only-student", "intersection")  # those needing no student scores of the teacher's tokens
WEIGHT_MODES = ("student_p", "teacher_p", "none")
TIMEOUT_S = 600.0


class TeacherError(RuntimeError):
    """The teacher did not answer a scoring request, or answered something unusable."""

    same_on_every_rank = False


@dataclass(frozen=True)
class ScoringRequest:
    """What the teacher is asked about one sample."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # the policy's, per response token
    top_logprobs: tuple | None  # the policy's top (logprob, token id) per response token, when asked


def score_payload(token_ids: Sequence[int], top_k: int = 0, token_ids_logprob: Sequence[int] = ()) -> dict:
    """SGLang's /generate body that scores `token_ids` without generating anything."""
    payload: dict[str, Any] = {
        "input_ids": list(token_ids),
        "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if top_k > 0:
        payload["top_logprobs_num"] = top_k
    if token_ids_logprob:
        payload["token_ids_logprob"] = sorted(set(token_ids_logprob))
    return payload


def post_json(url: str, payload: Mapping[str, Any], timeout: float = TIMEOUT_S) -> dict:
    body = json.dumps(payload).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except OSError as exc:  # URLError, HTTPError, timeouts, refused connections
        raise TeacherError(
            f"--rm-url {url}: the teacher did not answer a scoring request ({exc}); start it (python -m "
            "sglang.launch_server, or python -m miles.rollout.teacher_server) or fix the URL"
        ) from exc


def response_field(meta: Mapping[str, Any], field: str, length: int) -> list:
    """The per-position values of a teacher's answer for the last `length` input tokens (SGLang's
    first input position is a placeholder: radixark/miles 31f1ca961, _trim_input_field)."""
    values = meta.get(field)
    if values is None:
        raise TeacherError(
            f"the teacher's answer has no meta_info.{field}: is --rm-url an SGLang /generate endpoint?"
        )
    return values[1:][-length:] if length > 0 else []


def _entries(position) -> dict[int, float]:
    """{token id: logprob} of one position's (logprob, token id, text) entries."""
    return {int(e[1]): float(e[0]) for e in position or () if e is not None and e[0] is not None}


def reverse_kl(
    request: ScoringRequest, answer: Mapping[str, Any], top_k: int, strategy: str, weight_mode: str
) -> list[float]:
    """The per-token reverse KL of one sample from the teacher's answer (see the module docstring)."""
    meta = answer["meta_info"]
    n = len(request.response_ids)
    if top_k == 0:
        teacher = response_field(meta, "input_token_logprobs", n)
        return [s - float(t[0]) for s, t in zip(request.logprobs, teacher, strict=True)]
    teacher_top = [_entries(p) for p in response_field(meta, "input_top_logprobs", n)]
    teacher_on_student = [_entries(p) for p in response_field(meta, "input_token_ids_logprobs", n)]
    out = []
    for t in range(n):
        student = {int(i): float(lp) for lp, i in request.top_logprobs[t]}
        ids = list(student) if strategy == "only-student" else [i for i in student if i in teacher_top[t]]
        s_logps = [student[i] for i in ids]
        t_logps = [teacher_top[t].get(i, teacher_on_student[t].get(i)) for i in ids]
        if any(lp is None for lp in t_logps):
            raise TeacherError(
                f"the teacher's answer has no logprob for a token the policy ranked at position {t}"
            )
        weights = _weights(s_logps, t_logps, weight_mode)
        out.append(sum(w * (s - tl) for w, s, tl in zip(weights, s_logps, t_logps, strict=True)))
    return out


def _weights(student: list[float], teacher: list[float], mode: str) -> list[float]:
    """Softmax over the set of the policy's, the teacher's or no log-probabilities."""
    if not student:
        return []
    logps = {"student_p": student, "teacher_p": teacher, "none": [0.0] * len(student)}[mode]
    top = max(logps)
    exps = [math.exp(lp - top) for lp in logps]
    total = sum(exps)
    return [e / total for e in exps]
