"""Samples (one rollout response with its reward) and the padded tensors the trainer reads.

Per-token tensors are aligned with next-token targets: position t of a row holds the value
for token t+1 of the sequence, and `loss_mask` is 1 exactly on response tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch

from miles.train.rollout import Generation


@dataclass(frozen=True)
class Sample:
    prompt_index: int
    group: int  # position of its prompt in the rollout batch; samples of a group are consecutive
    generation: Generation
    response_text: str
    label: str
    reward: float
    advantage: float = 0.0
    # Its execution (a request of the rollout) and how many samples that execution was split
    # into (miles.train.generate); the tokens it trains on (None: its whole response).
    execution: int | None = None
    siblings: int = 1
    loss_mask: tuple[int, ...] | None = None
    # on-policy distillation: the reverse KL to the teacher of each response token (miles.train.distillation)
    opd_reverse_kl: tuple[float, ...] | None = None

    @property
    def truncated(self) -> bool:
        return self.generation.finish_reason == "length"


def executions(samples: Sequence[Sample]) -> list[list[int]]:
    """The samples' indices by execution, in order: consecutive samples of one execution
    (`execution` set and equal) together, every other sample alone."""
    out: list[list[int]] = []
    for i, s in enumerate(samples):
        if out and s.execution is not None and samples[out[-1][0]].execution == s.execution:
            out[-1].append(i)
        else:
            out.append([i])
    return out


# The fields that hold one value per target token ([B, T-1]); advantages only when per token.
PER_TOKEN = (
    "loss_mask", "rollout_logp", "old_logp", "ref_logp", "returns", "old_values", "advantages", "opd_reverse_kl",
)  # fmt: skip


@dataclass(frozen=True)
class TokenBatch:
    input_ids: torch.Tensor  # [B, T], right-padded prompt + response
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T-1], 1 on response-token targets
    advantages: torch.Tensor  # [B] per sample, or [B, T-1] per token (PPO's GAE, whitened ones)
    rollout_logp: torch.Tensor  # [B, T-1]
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    weights: torch.Tensor | None = None  # [B] per-sample loss weight (1 / siblings); None: all 1
    rewards: torch.Tensor | None = None  # [B]: each sample's reward (PPO's GAE pays it at its last token)
    opd_reverse_kl: torch.Tensor | None = None  # [B, T-1]: on-policy distillation's per-token signal
    returns: torch.Tensor | None = None  # [B, T-1]: PPO's value targets
    old_values: torch.Tensor | None = None  # [B, T-1]: the critic's values before its steps
    # [B, T, layers, top-k] int32: the experts the rollout engine routed each input position to
    # (-1: none recorded; miles.train.routing_replay), with --use-rollout-routing-replay
    routed_experts: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def with_(self, **changes) -> TokenBatch:
        return replace(self, **changes)

    def rows(self, index: Sequence[int] | slice) -> TokenBatch:
        """The sub-batch of the given rows, trimmed to its own longest sequence."""
        if isinstance(index, slice):
            picked = {k: v[index] if v is not None else None for k, v in self._fields().items()}
        else:
            idx = torch.as_tensor(list(index), dtype=torch.long)
            picked = {k: v.index_select(0, idx) if v is not None else None for k, v in self._fields().items()}
        width = int(picked["attention_mask"].sum(dim=1).max()) if picked["input_ids"].shape[0] else 1
        for key in ("input_ids", "attention_mask", "routed_experts"):
            if picked[key] is not None:
                picked[key] = picked[key][:, :width]
        for key in PER_TOKEN:
            if picked[key] is not None and picked[key].dim() == 2:
                picked[key] = picked[key][:, : width - 1]
        return TokenBatch(**picked)

    def _fields(self) -> dict[str, torch.Tensor | None]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def save_samples(path: str, samples: Sequence[Sample]) -> None:
    """Write a rollout's samples as JSON (--save-debug-rollout-data)."""
    rows = []
    for s in samples:
        row = asdict(s)
        routed = s.generation.routed_experts
        row["generation"]["routed_experts"] = None if routed is None else routed.tolist()
        rows.append(row)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rows, f)


def _generation(row: dict) -> Generation:
    routed = row.get("routed_experts")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in row.items() if k != "routed_experts"}
    return Generation(
        **fields, routed_experts=None if routed is None else torch.tensor(routed, dtype=torch.int32)
    )


def load_samples(path: str) -> list[Sample]:
    """The samples `save_samples` wrote (--load-debug-rollout-data)."""
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)
    return [
        Sample(
            **{
                **row,
                "generation": _generation(row["generation"]),
                **{
                    key: tuple(row[key])
                    for key in ("opd_reverse_kl", "loss_mask")
                    if row.get(key) is not None
                },
            }
        )
        for row in rows
    ]


def collate(samples: Sequence[Sample], pad_token_id: int = 0) -> TokenBatch:
    rows = [list(s.generation.prompt_ids) + list(s.generation.response_ids) for s in samples]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    rollout_logp = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    for i, (s, row) in enumerate(zip(samples, rows, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention[i, : len(row)] = 1
        start, n = len(s.generation.prompt_ids) - 1, len(s.generation.response_ids)
        mask = torch.ones(n) if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        loss_mask[i, start : start + n] = mask
        rollout_logp[i, start : start + n] = torch.tensor(s.generation.logprobs, dtype=torch.float32) * mask
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    weights = None
    if any(s.siblings != 1 for s in samples):
        weights = torch.tensor([1.0 / s.siblings for s in samples], dtype=torch.float32)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    opd = None
    if any(s.opd_reverse_kl is not None for s in samples):
        opd = torch.zeros_like(rollout_logp)
        for i, s in enumerate(samples):
            start = len(s.generation.prompt_ids) - 1
            opd[i, start : start + len(s.opd_reverse_kl or ())] = torch.tensor(
                s.opd_reverse_kl or (), dtype=torch.float32
            )
    return TokenBatch(
        input_ids,
        attention,
        loss_mask,
        advantages,
        rollout_logp,
        weights=weights,
        rewards=rewards,
        opd_reverse_kl=opd,
        routed_experts=_routed_experts(samples, width),
    )


def _routed_experts(samples: Sequence[Sample], width: int) -> torch.Tensor | None:
    """[B, width, layers, top-k] of the samples' routed experts (-1 where none), or None when no
    sample carries any; every sample must then carry them (miles.train.routing_replay)."""
    from miles.train.routing_replay import NOT_RECORDED, check_routed

    carried = [s.generation.routed_experts for s in samples]
    first = next((r for r in carried if r is not None), None)
    if first is None:
        return None
    out = torch.full((len(samples), width, *first.shape[1:]), NOT_RECORDED, dtype=torch.int32)
    for i, (s, routed) in enumerate(zip(samples, carried, strict=True)):
        g = s.generation
        check_routed(routed, len(g.prompt_ids), len(g.response_ids), f"sample {i} (prompt {s.prompt_index})")
        out[i, : routed.shape[0]] = routed
    return out
