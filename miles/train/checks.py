"""In-loop checks that `--ci-test` turns into assertions.

1. On the first optimizer step of a rollout the policy still equals the one that computed
   the old logprobs, so ppo_kl must be ~0 and no token may be clipped.
2. The rollout engine and the trainer hold the same weights, so their logprobs of the
   sampled tokens agree within a tolerance (the numerics differ: KV cache vs full forward).
3. After a weight sync the engine's weights equal the trainer's, bit for bit, except names
   matching `--check-weight-update-skip-list` (engines in processes of their own: their
   checksums of each tensor's bytes equal the trainer's). An engine that cannot hand out its tensors
   (SGLang) is checked instead by greedy continuations of fixed prompts: their logprobs
   under the engine and under the trainer agree within --ci-logprob-abs-diff-tol. Both sides
   score them at temperature 1: SGLang treats top_k 1 as greedy and returns the untempered
   logprobs (sglang 0.5.23 sampling_batch_info.py: is_all_greedy = top_k <= 1 for every
   request; sampler.py, Sampler.forward: log_softmax(logits) without the temperature there).
4. With --ci-metric-checker-key, the metric's last value reaches --ci-metric-checker-threshold.
   With --ci-load-grad-norm, each optimizer step's gradient norm and loss are those another run
   wrote with --ci-save-grad-norm (a replay of its saved rollouts, on another backend or layout)
   within the seed's bound (`STEP_TOL`).
5. Before the first rollout of a fresh run, what the rollout engine holds is the HF checkpoint the
   run names (--hf-checkpoint), tensor by tensor in the files' dtype, not only the trainer's
   copy: trainer and engine both loaded from --ref-load, a damaged or foreign one would pass
   check 3. An engine that hands out its tensors is compared itself; otherwise the tensors it
   is given (FP8 checkpoints: quantized as the engine receives them).
A failed check raises `CheckFailed` naming the rollout, the metric, the value and the bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

PROBE_PROMPTS = 4  # fixed prompts of the logprob weight check
# --ci-load-grad-norm's bound, the seed's: radixark/miles 31f1ca961
# miles/backends/training_utils/ci_utils.py, check_grad_norm (rel_tol 0.03, abs_tol 0.03).
STEP_TOL = 0.03
PROBE_TOKENS = 8  # greedy tokens generated for each


class CheckFailed(AssertionError):
    """An in-loop invariant of the trainer does not hold."""


def check_first_step(rollout_id: int, ppo_kl: float, clipfrac: float, tol: float) -> None:
    if abs(ppo_kl) > tol:
        raise CheckFailed(
            f"rollout {rollout_id}: train/ppo_kl = {ppo_kl:.3g} on the first step, expected |kl| <= {tol:g}: "
            "the old logprobs were not computed with the weights being trained (stale weights or "
            "non-deterministic forward)"
        )
    if clipfrac > 0:
        raise CheckFailed(
            f"rollout {rollout_id}: train/pg_clipfrac = {clipfrac:.3g} on the first step, expected 0: the "
            "policy ratio must be exactly 1 before any update"
        )


def check_logprob_agreement(rollout_id: int, abs_diff: float, tol: float) -> None:
    if not math.isfinite(abs_diff):
        raise CheckFailed(
            f"rollout {rollout_id}: train/train_rollout_logprob_abs_diff = {abs_diff}: the trainer's or the "
            "engine's logprobs are not finite, so the weights diverged (see train/grad_norm, "
            "train/skipped_steps; lower --lr); this is not a weight-sync mismatch"
        )
    if not abs_diff <= tol:
        raise CheckFailed(
            f"rollout {rollout_id}: train/train_rollout_logprob_abs_diff = {abs_diff:.3g} > {tol:g}: the "
            "rollout engine samples with different weights or numerics than the trainer (missed weight "
            "sync?); raise --ci-logprob-abs-diff-tol only for a known precision gap"
        )


def check_metric_threshold(key: str, values: dict[int, float], threshold: float) -> None:
    """--ci-metric-checker-key/threshold: the metric's last logged value must reach the threshold."""
    if not values:
        raise CheckFailed(f"--ci-metric-checker-key {key}: the run never logged it (is --eval-interval set?)")
    step = max(values)
    if not values[step] >= threshold:
        raise CheckFailed(
            f"{key} = {values[step]:.4g} at rollout {step}, below --ci-metric-checker-threshold {threshold:g}"
        )


def skipped(name: str, skip_list: Sequence[str]) -> bool:
    return any(pattern and pattern in name for pattern in skip_list)


def check_weights_equal(
    rollout_id: int,
    engine_weights: Iterable[tuple[str, object]],
    trainer_weights: Mapping[str, object],
    skip_list: Sequence[str] = (),
) -> int:
    """Compare every engine weight with the trainer's; returns how many were compared."""
    import torch

    engine = {name: t for name, t in engine_weights if not skipped(name, skip_list)}
    trainer = {name: t for name, t in trainer_weights.items() if not skipped(name, skip_list)}
    missing = sorted(set(trainer) - set(engine))
    if missing:
        raise CheckFailed(
            f"rollout {rollout_id}: the rollout engine lacks trainer weight(s) {missing[:5]}; add them to "
            "--check-weight-update-skip-list only if the engine legitimately does not hold them"
        )
    differing = []
    for name, tensor in engine.items():
        if name not in trainer:
            continue
        if not torch.isfinite(trainer[name]).all():
            raise CheckFailed(
                f"rollout {rollout_id}: the trainer's weight {name} is not finite: training diverged "
                "(see train/grad_norm, train/skipped_steps; lower --lr); this is not a weight-sync mismatch"
            )
        expected = trainer[name].to(device=tensor.device, dtype=tensor.dtype)
        if not torch.equal(tensor.detach(), expected):
            diff = (tensor.detach().float() - expected.float()).abs().max().item()
            differing.append(f"{name} (max abs diff {diff:.3g})")
    if differing:
        raise CheckFailed(
            f"rollout {rollout_id}: after the weight update the rollout engine differs from the trainer in "
            f"{len(differing)} tensor(s): {', '.join(differing[:5])}"
        )
    return len(engine)


def check_rollout_complete(rollout_id: int, samples, groups: int, group_size: int) -> None:
    """The rollout holds every group, each with exactly `group_size` executions (an engine that
    died mid-rollout lost none of its requests, and none was counted twice)."""
    from miles.train.batch import executions

    counts: dict[int, int] = {}
    for execution in executions(samples):
        group = samples[execution[0]].group
        counts[group] = counts.get(group, 0) + 1
    wrong = {g: n for g, n in counts.items() if n != group_size}
    missing = sorted(set(range(groups)) - set(counts))
    if wrong or missing or len(counts) != groups:
        raise CheckFailed(
            f"rollout {rollout_id}: the rollout is not {groups} groups of {group_size}: groups missing {missing[:5]}, "
            f"groups of another size {dict(list(wrong.items())[:5])}: a request was lost or answered twice"
        )


def check_weight_checksums(
    rollout_id: int,
    engines: Mapping[str, Mapping[str, str]],
    trainer_weights: Mapping[str, object],
    skip_list: Sequence[str] = (),
) -> int:
    """Every engine's checksum of each trainer weight (in the engine's dtype) equals the trainer's
    tensor's; returns how many were compared. Checksums of the bytes: equal means bit for bit."""
    from miles.train.remote.checksums import tensor_checksum

    compared = 0
    for engine, sums in engines.items():
        differing = []
        for name, tensor in trainer_weights.items():
            if skipped(name, skip_list):
                continue
            if name not in sums:
                raise CheckFailed(
                    f"rollout {rollout_id}: rollout engine {engine} lacks trainer weight {name}; add it to "
                    "--check-weight-update-skip-list only if the engine legitimately does not hold it"
                )
            compared += 1
            if tensor_checksum(tensor) != sums[name]:
                differing.append(name)
        if differing:
            raise CheckFailed(
                f"rollout {rollout_id}: after the weight update rollout engine {engine} differs from the trainer in "
                f"{len(differing)} tensor(s) (checksums of their bytes): {', '.join(differing[:5])}"
            )
    return compared


def probe_sampling(sampling):
    """Greedy (top_k 1) at temperature 1: the tokens are a function of the engine's weights only,
    and the logprobs are the untempered ones SGLang returns for greedy requests."""
    from dataclasses import replace

    return replace(
        sampling,
        temperature=1.0,
        top_k=1,
        top_p=1.0,
        max_response_len=min(PROBE_TOKENS, sampling.max_response_len),
    )


def probe_logprob_gap(engine, backend, prompts: Sequence[Sequence[int]], sampling) -> float:
    """Mean |engine - trainer| logprob over greedy continuations of `prompts` (every rank calls
    this: generation and the trainer's forward may be collectives), both at temperature 1."""
    from miles.train.batch import Sample, collate
    from miles.train.distributed import all_reduce_sum

    generations = engine.generate([list(p) for p in prompts], probe_sampling(sampling), seed=0)
    batch = collate([Sample(i, i, g, "", "", 0.0) for i, g in enumerate(generations)])
    with backend.scoring_temperature(1.0):
        trainer = backend.logprobs(batch)
    gap, tokens = all_reduce_sum(
        [float(((trainer - batch.rollout_logp).abs() * batch.loss_mask).sum()), float(batch.loss_mask.sum())]
    )
    return gap / max(tokens, 1.0)


def check_probe_logprobs(rollout_id: int, gap: float, tol: float) -> None:
    if not gap <= tol:
        raise CheckFailed(
            f"rollout {rollout_id}: after the weight update the rollout engine's logprobs of {PROBE_PROMPTS} fixed "
            f"prompts differ from the trainer's by {gap:.3g} on average (> {tol:g}): the engine did not load "
            "the trainer's weights"
        )


class NotTheCheckpoint(CheckFailed):
    """The weights the run starts from are not the HF checkpoint it names (every rank raises it)."""

    same_on_every_rank = True


class CheckpointComparison:
    """Compares (checkpoint-named) tensors with the same-named tensors of an HF checkpoint's
    files, one at a time, in the file's dtype; names the file holds no tensor for are skipped."""

    def __init__(self, hf_dir, skip_list: Sequence[str] = ()):
        from miles.ckpt.shards import CheckpointReader
        from miles.train.fp8_export import fp8_export_for

        self.hf_dir = hf_dir
        self.reader = CheckpointReader(hf_dir)
        self.fp8 = fp8_export_for(hf_dir)
        self.skip_list = skip_list
        self.compared = 0
        self.differing: list[str] = []

    def add(self, name: str, tensor) -> None:
        pairs = self.fp8([(name, tensor)]) if self.fp8 is not None else [(name, tensor)]
        for key, value in pairs:
            if skipped(key, self.skip_list) or key not in self.reader.files.weight_map:
                continue
            self._compare(key, value)

    def _compare(self, name: str, tensor) -> None:
        import torch

        want = self.reader.read(name)
        got = tensor.detach().to("cpu")
        self.compared += 1
        if tuple(got.shape) != tuple(want.shape):
            self.differing.append(f"{name} (shape {list(got.shape)}, the file's {list(want.shape)})")
        elif not torch.equal(got.to(want.dtype), want):
            diff = (got.float() - want.float()).abs().max().item()
            self.differing.append(f"{name} (max abs diff {diff:.3g})")

    def teed(self, named_tensors: Iterable[tuple[str, object]]):
        """The same stream, each tensor compared as it passes."""
        for name, tensor in named_tensors:
            self.add(name, tensor)
            yield name, tensor

    def verdict(self, what: str) -> str | None:
        """None when every compared tensor matched (and some were); else one line saying which did not."""
        self.reader.close()
        if not self.compared:
            return f"{what}: no tensor of {self.hf_dir} could be compared (no common names); nothing was verified"
        if not self.differing:
            return None
        return (
            f"{what} are not the HF checkpoint the run names (--hf-checkpoint {self.hf_dir}) in "
            f"{len(self.differing)} of {self.compared} tensor(s): {', '.join(self.differing[:5])}; the "
            "trainer's starting weights (--ref-load on the Megatron backend) are damaged or another model's: "
            "convert --hf-checkpoint again with `invoke prepare-ckpt` and load that"
        )


class StepRecord:
    """--ci-save-grad-norm PATH / --ci-load-grad-norm PATH: each optimizer step's gradient norm and
    loss written to, or checked against, PATH.format(role="actor", rollout_id=R, step_id=S) (a
    JSON object keyed "R/S", so a PATH without fields holds every step of the run). Every rank
    calls it with the step's (rank-reduced) values; rank 0 reads and writes, and a mismatch
    stops every rank."""

    def __init__(self, save: str | None, load: str | None, is_main: bool):
        self.save, self.load, self.is_main = save, load, is_main
        self.written: dict[str, dict] = {}  # what this run wrote, by file

    def __call__(self, rollout_id: int, step_id: int, step: Mapping[str, float]) -> None:
        values = {"grad_norm": float(step["grad_norm"]), "loss": float(step["loss"])}
        key = f"{rollout_id}/{step_id}"
        if self.save and self.is_main:
            self._write(self._path(self.save, rollout_id, step_id), key, values)
        if self.load:
            from miles.train.distributed import all_gather_objects

            problem = self._compare(rollout_id, step_id, key, values) if self.is_main else None
            found = [p for p in all_gather_objects(problem) if p]
            if found:
                raise CheckFailed(found[0])

    @staticmethod
    def _path(pattern: str, rollout_id: int, step_id: int) -> str:
        return pattern.format(role="actor", rollout_id=rollout_id, step_id=step_id)

    def _write(self, path: str, key: str, values: dict) -> None:
        import json
        import os

        held = self.written.setdefault(path, {})
        held[key] = values
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(held, f, indent=1)
        os.replace(tmp, path)

    def _compare(self, rollout_id: int, step_id: int, key: str, values: dict) -> str | None:
        import json

        path = self._path(self.load, rollout_id, step_id)
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError) as exc:
            return f"--ci-load-grad-norm {self.load}: cannot read {path} ({exc}); write it with --ci-save-grad-norm"
        if key not in saved:
            return (
                f"--ci-load-grad-norm {self.load}: {path} holds no step {key} (rollout/step); it has "
                f"{', '.join(sorted(saved)[:6]) or 'none'}: the replayed run's batches do not match the saved one's"
            )
        for metric, value in values.items():
            want = saved[key][metric]
            if not math.isclose(value, want, rel_tol=STEP_TOL, abs_tol=STEP_TOL):
                return (
                    f"rollout {rollout_id}, step {step_id}: train/{metric} = {value:.6g}, but the saved run's "
                    f"({path}) is {want:.6g} (beyond rel/abs {STEP_TOL}): the two runs do not train alike"
                )
        return None
