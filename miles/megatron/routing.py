"""Rollout routing replay (R3) in megatron-core's routers: the rollout engine's experts instead of top-k.

megatron-core 0.16.1's TopKRouter hands its top-k to `router.router_replay.get_replay_topk` when
one is set (transformer/moe/moe_utils.py, topk_routing_with_score_function); its own RouterReplay
keeps one target per router for a whole pass and replays backward recomputes from a list the
caller must switch to. Here each router gets a `RouterReplay` that reads the targets of the
micro-batch the schedule is running (set by the backend's forward step): the experts of each
token this rank's router sees, in its order (sequence-major [seq, rows], this context-parallel
rank's positions, this tensor-parallel rank's share under sequence parallelism). A forward that
activation recomputation will repeat in the backward (megatron's CheckpointFunction runs it
without grad) queues its targets, and the recomputation (in training, with grad) takes them in
order, so a pipeline's interleaved forwards and backwards replay each micro-batch's own experts.
The weights of the chosen experts are read from the router's scores there
(`replayed`, shared with the transformers routers of miles.train.routing_replay), as
megatron's own replay does.
"""

from __future__ import annotations

from collections import deque

import torch

NOT_RECORDED = -1  # a token whose experts the engine did not record: its router's own top-k


class RoutingReplayError(RuntimeError):
    """Routing replay cannot act on this model or batch; the message says why and the fix."""

    same_on_every_rank = True


def replayed(
    scores: torch.Tensor, own: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of a top-k whose indices are `target` [tokens, k] where recorded (`own`
    where a row is NOT_RECORDED), the values read from `scores` there (so they keep its gradient)."""
    target = target.to(device=own.device, dtype=own.dtype)
    recorded = (target != NOT_RECORDED).all(dim=-1, keepdim=True)
    indices = torch.where(recorded, target, own)
    return scores.gather(-1, indices), indices


class RouterReplay:
    """The replay hook of one megatron-core TopKRouter (its decoder layer: layer_number - 1)."""

    def __init__(self, router, targets: Targets):
        self.router = router
        self.layer = router.layer_number - 1
        self.targets = targets
        self.recomputed: deque[torch.Tensor] = deque()

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        return self.replay(scores, probs, indices)

    def replay(self, scores, probs, indices):
        """(values, indices) of the router's own top-k, or of the rollout engine's experts where
        this micro-batch carries them (the values read from `scores`)."""
        target = self._target()
        if target is None:
            return probs, indices
        if target.shape != indices.shape:
            raise RoutingReplayError(
                f"decoder layer {self.layer}: the replayed experts are {tuple(target.shape)} for a router input of "
                f"{tuple(indices.shape)} (tokens x top-k); the micro-batch's routed experts do not match its tokens"
            )
        return replayed(scores, indices, target)

    def _target(self) -> torch.Tensor | None:
        training = self.router.training
        if training and torch.is_grad_enabled() and self.recomputed:
            return self.recomputed.popleft()  # a recomputation in the backward: its forward's experts
        target = self.targets.of(self.layer)
        if target is not None and training and not torch.is_grad_enabled():
            self.recomputed.append(target)  # the backward will recompute this forward
        return target


def replayed_picks(router, scores: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """A family's own router's expert `picks` [tokens, k] (its top-k of `scores`), or the rollout
    engine's experts where routing replay is installed on it (a router class that calls this sets
    `replays_routing = True`, which `install` reads). Call it with grad enabled, as the router's own
    forward runs: the hook reads a training forward without grad as one the backward recomputes."""
    hook = getattr(router, "router_replay", None)
    return picks if hook is None else hook.replay(scores, None, picks)[1]


class Targets:
    """The routed experts of the micro-batch the schedule runs, by decoder layer, as the routers of
    this rank see its tokens."""

    def __init__(self, *, sequence_parallel: bool):
        self.sequence_parallel = sequence_parallel
        self.current: dict[int, torch.Tensor] | None = None
        self.hooks: list[RouterReplay] = []

    def of(self, layer: int) -> torch.Tensor | None:
        # a carried MTP layer (no decoder layer of the engine) routes by its own top-k, as the seed's
        return None if self.current is None else self.current.get(layer)

    def set(self, mb) -> None:
        """The targets of a miles.megatron.loss.MicroBatch (its batch's routed_experts)."""
        routed = mb.batch.routed_experts
        if routed is None:
            raise RoutingReplayError(
                "--use-rollout-routing-replay: a training batch came without the rollout engine's routed experts"
            )
        rows, seq = mb.tokens.shape
        full = torch.full((rows, seq, *routed.shape[2:]), NOT_RECORDED, dtype=routed.dtype)
        full[: routed.shape[0], : routed.shape[1]] = routed
        local = full[:, mb.positions.cpu()].transpose(0, 1)  # [seq/cp, rows, layers, k], as the router reads
        if self.sequence_parallel:
            from megatron.core import parallel_state

            tp = parallel_state.get_tensor_model_parallel_world_size()
            share = local.shape[0] // tp
            rank = parallel_state.get_tensor_model_parallel_rank()
            local = local[rank * share : (rank + 1) * share]
        flat = local.reshape(-1, *routed.shape[2:]).to(mb.tokens.device, torch.long)
        self.current = {hook.layer: flat[:, hook.layer] for hook in self.hooks if hook.layer < flat.shape[1]}

    def clear(self, *, check: bool = True) -> None:
        """After a pass of the schedule: every recomputation found its forward's experts."""
        self.current = None
        left = sum(len(hook.recomputed) for hook in self.hooks)
        for hook in self.hooks:
            hook.recomputed.clear()
        if left and check:
            raise RoutingReplayError(
                f"{left} recorded forward(s) were never recomputed in the backward: the schedule's activation "
                "recomputation did not run as routing replay expects"
            )


def install(chunks, tc) -> Targets:
    """Replay hooks on every megatron-core TopKRouter of the chunks; refused where a router picks
    its experts elsewhere than through megatron-core's top-k (a family's own routing that does not
    consult the hook, `replays_routing`; Sinkhorn; Transformer Engine's fused router)."""
    from megatron.core.transformer.moe.router import TopKRouter

    if tc.moe_router_fusion:
        raise RoutingReplayError(
            "--use-rollout-routing-replay with --moe-router-fusion: Transformer Engine's fused router picks the "
            "experts inside one kernel, past megatron-core's replay hook; drop --moe-router-fusion"
        )
    targets = Targets(sequence_parallel=bool(tc.sequence_parallel))
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if not isinstance(module, TopKRouter):
                continue
            own = type(module).routing is not TopKRouter.routing and not getattr(
                type(module), "replays_routing", False
            )
            if own or module.routing_type == "sinkhorn":
                raise RoutingReplayError(
                    f"--use-rollout-routing-replay: router {name} ({type(module).__name__}) picks its experts with its "
                    "own routing, not megatron-core's top-k that routing replay hooks; train this model with "
                    "--train-backend fsdp, or drop the flag"
                )
            hook = RouterReplay(module, targets)
            module.router_replay = hook
            targets.hooks.append(hook)
    if not targets.hooks and not _pipeline_stage_without_moe(chunks):
        raise RoutingReplayError(
            "--use-rollout-routing-replay: the model has no mixture-of-experts router to replay; drop the flag"
        )
    return targets


def _pipeline_stage_without_moe(chunks) -> bool:
    """Whether some other pipeline stage may hold the routers (a stage of dense layers only)."""
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size() > 1
