"""Per-rollout metrics: reduced over ranks, recorded through miles.metrics.capture, printed.

Keys follow the seeds' framework so the CI metric gates read them unchanged:
`rollout/raw_reward`, `train/grad_norm`, `train/ppo_kl`, `train/pg_clipfrac`,
`train/train_rollout_logprob_abs_diff`, `train/train_rollout_kl`, `train/loss`,
`train/entropy`, ... and `perf/*` timings in seconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

from miles.metrics import capture
from miles.train.algorithm import LOSS_SUMS
from miles.train.batch import Sample

CONSOLE_KEYS = (
    ("reward", "rollout/raw_reward", "{:.3f}"),
    ("exact", "rollout/exact_match", "{:.2f}"),
    ("loss", "train/loss", "{:+.4f}"),
    ("kl", "train/ppo_kl", "{:+.1e}"),
    ("clip", "train/pg_clipfrac", "{:.3f}"),
    ("gnorm", "train/grad_norm", "{:.3f}"),
    ("ent", "train/entropy", "{:.3f}"),
    ("lp_diff", "train/train_rollout_logprob_abs_diff", "{:.1e}"),
    ("len", "rollout/response_len", "{:.1f}"),
)


def rollout_metrics(
    samples: Sequence[Sample], rollout_time: float, *, exact: bool = False
) -> dict[str, float]:
    """The rollout's metrics; with `exact`, also the share of responses that are exactly their
    label (the synthetic tasks, whose label is the whole answer)."""
    n = len(samples)
    lengths = [len(s.generation.response_ids) for s in samples]
    tokens = sum(lengths)
    rewards = [s.reward for s in samples]
    mean = sum(rewards) / n
    metrics = {
        "rollout/raw_reward": mean,
        "rollout/reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "rollout/response_len": tokens / n,
        "rollout/truncated_ratio": sum(s.truncated for s in samples) / n,
        "rollout/zero_std_groups": _zero_std_groups(samples),
        "perf/rollout_time": rollout_time,
        "perf/rollout_tokens_per_s": tokens / rollout_time if rollout_time > 0 else 0.0,
    }
    kls = [kl for s in samples if s.opd_reverse_kl is not None for kl in s.opd_reverse_kl]
    if kls:  # on-policy distillation: the policy's KL to the teacher, on its own samples
        metrics["rollout/opd_reverse_kl"] = sum(kls) / len(kls)
    if exact:
        metrics["rollout/exact_match"] = sum(s.response_text.strip() == s.label.strip() for s in samples) / n
    return metrics


def _zero_std_groups(samples: Sequence[Sample]) -> float:
    """Share of groups whose rewards are all equal (they teach nothing this step)."""
    groups: dict[int, set[float]] = {}
    for s in samples:
        groups.setdefault(s.group, set()).add(s.reward)
    return sum(len(v) == 1 for v in groups.values()) / max(1, len(groups))


def train_metrics(steps: Sequence[Mapping[str, float]], use_tis: bool) -> dict[str, float]:
    """`train/*` of one rollout's optimizer steps: loss, grad_norm and lr averaged over the
    steps; each loss term (token-summed over ranks, see `LOSS_SUMS`) per token of the rollout."""
    # a step may leave out a term no component computed (mtp_loss without --enable-mtp-training)
    total = {k: sum(step.get(k, 0.0) for step in steps) for k in (*LOSS_SUMS, "loss", "grad_norm", "lr")}
    metrics = {f"train/{k}": total[k] / len(steps) for k in ("loss", "grad_norm", "lr")}
    per_token = [k for k in LOSS_SUMS if k != "tokens" and (use_tis or k != "tis_weight")]
    if not total["mtp_loss"]:  # no MTP layer trained (a cross-entropy is never 0)
        per_token.remove("mtp_loss")
    return metrics | {f"train/{k}": total[k] / total["tokens"] for k in per_token}


def record(rollout_id: int, metrics: Mapping[str, float]) -> None:
    capture.log(rollout_id, metrics)


def console_line(rollout_id: int, num_rollout: int, metrics: Mapping[str, float]) -> str:
    parts = [f"rollout {rollout_id + 1}/{num_rollout}"]
    for label, key, fmt in CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    parts += [f"{key} {value:.3f}" for key, value in metrics.items() if key.startswith("eval/")]
    timing = f"{metrics.get('perf/step_time', 0):.2f}s"
    if "perf/train_time" in metrics:
        timing += f" (rollout {metrics['perf/rollout_time']:.2f}s, train {metrics['perf/train_time']:.2f}s)"
    parts.append(timing)
    return " | ".join(parts)


@contextlib.contextmanager
def peak_host_memory() -> Iterator[dict[str, float]]:
    """The process's peak resident memory over the block, as `perf/rollout_peak_rss_mb` in the
    dict it yields (filled when the block ends), on Linux, which can reset the peak
    (/proc/self/clear_refs, 5); elsewhere the dict stays empty."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        yield out
        return
    yield out
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                out["perf/rollout_peak_rss_mb"] = int(line.split()[1]) / 1024
