"""Rollout routing replay (R3): the experts the rollout engine chose for each token, replayed in training.

A mixture-of-experts router picks each token's top-k experts from its scores. The rollout engine
and the trainer compute those scores with different kernels, and a step moves them, so a token
whose scores are nearly tied can go to other experts in training than in the rollout: its logprob
then differs by far more than rounding. With --use-rollout-routing-replay the rollout engine
records every token's experts at every MoE layer, and the trainer's routers take those instead of
their own top-k. The router's weighting of the chosen experts is its own (the weights are read
from its scores at the replayed experts), so the loss still reaches the router's parameters.

Layout, as SGLang returns it (sglang 0.5.23, srt/state_capturer/routed_experts.py and the
scheduler's `_maybe_collect_routed_experts`): int32 [tokens - 1, num_hidden_layers, top_k], row t
the experts that routed input position t of prompt + response (the last token is never fed to the
model), a row for every decoder layer, NOT_RECORDED (-1) where nothing routed (a dense layer). A
token without a recorded row (the last one, padding) is routed by the trainer's own top-k.

Transformers models (the built-in engine, --train-backend fsdp/ddp): the routers are the modules of
the family's `router_classes` (miles.families); each selects its experts with one torch.topk of
k = its `top_k` over its `num_experts` scores, and that call, and only that one, is recorded or
replayed while the router's forward runs. megatron-core's routers: miles.megatron.routing.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from miles.megatron.routing import NOT_RECORDED, RoutingReplayError, replayed

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def is_selection(args: Sequence, kwargs: Mapping, top_k: int, num_experts: int) -> bool:
    """Whether a torch.topk call (its arguments) is a router's expert selection: k = top_k over the
    last dimension of [tokens, num_experts] scores (a group-limited router's group top-k is not)."""
    scores = args[0] if args else kwargs.get("input")
    k = args[1] if len(args) > 1 else kwargs.get("k")
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    return (
        torch.is_tensor(scores)
        and scores.dim() == 2
        and scores.shape[-1] == num_experts
        and k == top_k
        and dim in (-1, 1)
    )


@dataclass
class _Router:
    layer: int  # its decoder layer
    top_k: int
    num_experts: int


class _Selection(TorchFunctionMode):
    """Inside one router forward: its expert selection recorded, or replaced by `target`."""

    def __init__(self, router: _Router, target: torch.Tensor | None):
        super().__init__()
        self.router, self.target = router, target
        self.chosen: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (torch.topk, torch.Tensor.topk) or not is_selection(
            args, kwargs, self.router.top_k, self.router.num_experts
        ):
            return func(*args, **kwargs)
        own = func(*args, **kwargs)
        if self.target is None:
            self.chosen.append(own.indices.detach())
            return own
        scores = args[0] if args else kwargs["input"]
        if self.target.shape != own.indices.shape:
            raise RoutingReplayError(
                f"decoder layer {self.router.layer}: the replayed experts are {tuple(self.target.shape)} for a "
                f"forward of {tuple(own.indices.shape)} (tokens x top-k); the batch's routed experts do not "
                "belong to its tokens"
            )
        values, indices = replayed(scores, own.indices, self.target)
        self.chosen.append(indices.detach())
        return torch.return_types.topk((values, indices))


class RouterHooks:
    """The routers of one transformers model, recording or replaying their expert selections."""

    def __init__(self, model, router_classes: Sequence[str], num_layers: int):
        self.num_layers = num_layers
        self.routers: list[_Router] = []
        self._targets: dict[int, torch.Tensor] | None = None
        self._recorded: dict[int, list[torch.Tensor]] | None = None
        for name, module in model.named_modules():
            if type(module).__name__ in router_classes:
                self._hook(name, module)
        if not self.routers:
            raise RoutingReplayError(
                f"{type(model).__name__} has no router of {', '.join(router_classes) or 'no class'}: routing replay "
                "needs a mixture-of-experts model whose family names its routers (miles.families)"
            )
        self.top_k = self.routers[0].top_k

    def _hook(self, name: str, module) -> None:
        found = _LAYER.search(name)
        if found is None or not hasattr(module, "top_k") or not hasattr(module, "num_experts"):
            raise RoutingReplayError(
                f"router {name} ({type(module).__name__}): routing replay reads a router's decoder layer from "
                "its name (layers.<i>.) and its top_k and num_experts attributes; this one lacks them"
            )
        router = _Router(int(found.group(1)), int(module.top_k), int(module.num_experts))
        self.routers.append(router)
        original = module.forward

        def forward(*args, **kwargs):
            target = None if self._targets is None else self._targets[router.layer]
            if target is None and self._recorded is None:
                return original(*args, **kwargs)
            selection = _Selection(router, target)
            with selection:
                out = original(*args, **kwargs)
            if len(selection.chosen) != 1:
                raise RoutingReplayError(
                    f"router {name} ({type(module).__name__}) made {len(selection.chosen)} top-{router.top_k} "
                    f"selections over {router.num_experts} experts in one forward, not one: routing replay cannot "
                    "tell which one picks the experts"
                )
            if self._recorded is not None:
                self._recorded.setdefault(router.layer, []).append(selection.chosen[0])
            return out

        module.forward = forward

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recording]:
        """Every router forward inside the block records its experts (`Recording.take` after each
        forward of the model)."""
        self._recorded = {}
        try:
            yield Recording(self)
        finally:
            self._recorded = None

    @contextlib.contextmanager
    def replaying(self, routed: torch.Tensor) -> Iterator[None]:
        """Inside the block the routers pick the experts of `routed` [rows, width, layers, top_k] for
        a forward of those rows (its backward too: a recomputed forward replays the same)."""
        rows, width, layers, k = routed.shape
        if layers != self.num_layers or k != self.top_k:
            raise RoutingReplayError(
                f"the batch's routed experts are {layers} layers x top-{k}, the model {self.num_layers} layers x "
                f"top-{self.top_k}: they were recorded with another model"
            )
        self._targets = {r.layer: routed[:, :, r.layer, :].reshape(rows * width, k) for r in self.routers}
        try:
            yield
        finally:
            self._targets = None

    def take(self) -> dict[int, torch.Tensor]:
        """The experts [tokens, top_k] each MoE layer chose in the forward since the last take."""
        recorded = self._recorded or {}
        out = {}
        for layer, chosen in recorded.items():
            if len(chosen) != 1:
                raise RoutingReplayError(
                    f"decoder layer {layer} was routed {len(chosen)} times in one forward"
                )
            out[layer] = chosen[0]
        recorded.clear()
        return out

    def stacked(self, chosen: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """[tokens, num_layers, top_k] int32 of one forward's choices (NOT_RECORDED on other layers)."""
        tokens = next(iter(chosen.values())).shape[0]
        out = torch.full((tokens, self.num_layers, self.top_k), NOT_RECORDED, dtype=torch.int32)
        for layer, indices in chosen.items():
            out[:, layer, :] = indices.to("cpu", torch.int32)
        return out


class Recording:
    """What the routers chose in each forward of a `RouterHooks.recording` block."""

    def __init__(self, hooks: RouterHooks):
        self.hooks = hooks

    def take(self) -> torch.Tensor:
        """[tokens, num_layers, top_k] of the last forward (tokens in the forward's row-major order)."""
        return self.hooks.stacked(self.hooks.take())


def router_hooks(model) -> RouterHooks:
    """The hooks on the routers of a transformers model of a miles family."""
    from miles.families import family_of
    from miles.families.facts import text_config

    config = text_config(model.config.to_dict())
    family = family_of(config)
    classes = family.router_classes if family is not None else ()
    if not classes:
        raise RoutingReplayError(
            f"model_type {config.get('model_type')!r} declares no top-k router (miles.families): "
            "--use-rollout-routing-replay needs a mixture-of-experts model; drop the flag"
        )
    return RouterHooks(model, classes, int(config["num_hidden_layers"]))


def check_routed(routed, prompt_len: int, response_len: int, where: str) -> None:
    """A sample's routed experts cover each of its fed tokens: prompt + response - 1 rows."""
    want = prompt_len + response_len - 1
    if routed is None or routed.shape[0] != want:
        got = "none" if routed is None else f"{routed.shape[0]} rows"
        raise RoutingReplayError(
            f"{where}: routing replay needs the experts of each of its {want} fed tokens (prompt {prompt_len} + "
            f"response {response_len} - 1), got {got}; the rollout engine must record them "
            "(--use-rollout-routing-replay on the engine that generated it)"
        )
