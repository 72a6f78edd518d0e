"""Rollout engines: turn prompts into sampled responses with per-token logprobs.

`RolloutEngine` is the interface the trainer talks to; `TorchRolloutEngine` is the built-in
engine (an in-process copy of the policy, batched sampling over a KV cache), and
`miles.train.sglang_engine.SGLangRolloutEngine` serves the same interface on GPU machines.
Logprobs are those of softmax(logits / temperature) before top-p/top-k truncation, which is
what the trainer recomputes, so the two can be compared token by token.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from miles.train.config import CheckpointConfig, OptimizerConfig, RolloutConfig, SamplingConfig, SGLangConfig


@dataclass(frozen=True)
class Generation:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # one per response token
    finish_reason: str  # "stop" (a stop token was sampled, and kept), "length", or "abort" (cut short)
    # with SamplingConfig.top_logprobs k: the k most likely (logprob, token id) of each response position
    top_logprobs: tuple[tuple[tuple[float, int], ...], ...] | None = None
    # with --use-rollout-routing-replay: int32 [prompt + response - 1, layers, top-k], the experts
    # that routed each fed token at each decoder layer (miles.train.routing_replay)
    routed_experts: object = field(default=None, compare=False, repr=False)


class RolloutEngineError(RuntimeError):
    """The rollout engine cannot sample correctly with this model or library; says why and the fix."""


# transformers renamed the KV-cache argument of every causal LM's forward from
# `past_key_values` (5.19 and before) to `cache` (5.24 keeps the old name as a deprecated
# alias). A name the forward does not declare falls into its **kwargs and is ignored, so
# decoding would silently run without its context: the name is read from the signature.
CACHE_KEYWORDS = ("cache", "past_key_values")


def cache_keyword(model) -> str:
    """The keyword under which `model.forward` takes its KV cache in the installed transformers."""
    params = inspect.signature(model.forward).parameters
    for name in CACHE_KEYWORDS:
        if name in params:
            return name
    import transformers

    raise RolloutEngineError(
        f"{type(model).__name__}.forward (transformers {transformers.__version__}) declares none of "
        f"{', '.join(CACHE_KEYWORDS)}: the built-in rollout engine cannot pass it a KV cache; install the "
        "lane's pinned transformers (requirements/<lane>.txt)"
    )


class RolloutEngine(abc.ABC):
    """What the trainer needs from a rollout engine. What it needs to know about one is declared
    here as properties (the trainer never asks which class it is); the flags it acts on name it on
    their fields (`by=torch` / `by=sglang`, miles.train.config)."""

    # The --rollout-engine value that selects it; how notes and logs name it.
    name: str = ""
    # named_weights() returns the engine's own tensors, so the weight check can be bit-exact;
    # an engine that cannot expose them is checked by the logprobs of fixed sequences.
    exact_weights = True
    # weight_checksums() returns the engine's own checksums of its tensors (engines in other
    # processes), so the weight check is bit-exact without moving the tensors.
    checksummed = False
    # The names update_weights takes: "model", those of the installed transformers class's
    # state dict (transformers 5 keeps a layer's experts fused); "checkpoint", those of the
    # checkpoint files (one tensor per expert), as SGLang's loaders read them.
    weight_names = "model"
    # It holds its own memory on the training GPUs and gives it back while the trainer steps
    # (release_memory / resume_memory); the SGLang engine does with --colocate/--offload-rollout.
    colocated = False
    # The same seed gives the same samples.
    seeded = True

    @property
    def weight_dtype(self):
        """The dtype the engine holds its floating-point weights in: the trainer casts each tensor
        to it before the push (None: pushed as the trainer holds them)."""
        return None

    @property
    def local_model(self):
        """The Hugging Face model the engine samples with in this process (its generation
        config says how it ends a sequence), or None when the model lives elsewhere."""
        return None

    @property
    def holds_mtp_layers(self) -> bool:
        """Whether it takes the checkpoint's MTP layers with the weights (SGLang loads them as its
        draft model; the built-in engine holds them only to draft with)."""
        return True

    @abc.abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        """One sampled response per prompt, in order; the same seed gives the same samples."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, object]]) -> None:
        """Load the trainer's current weights (full, unsharded tensors by HF parameter name)."""

    @abc.abstractmethod
    def named_weights(self) -> Iterator[tuple[str, object]]:
        """The weights the engine samples with, for the weight-update check."""

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        """Each engine's checksum of every tensor it holds (miles.train.remote.checksums), where
        `checksummed`; this process may hold none of them (an empty dict)."""
        raise NotImplementedError(f"the {self.name} rollout engine does not checksum its weights")

    def rollout_metrics(self) -> dict[str, float]:
        """What the engine reports of the last rollout (requests retried, engines alive)."""
        return {}

    def release_memory(self) -> None:  # noqa: B027 (an engine without its own memory pool frees nothing)
        """Free GPU memory the engine holds while the trainer steps (colocated engines)."""

    def resume_memory(self) -> None:  # noqa: B027
        """Take back what `release_memory` freed; called before sampling or loading weights."""

    def close(self) -> None:  # noqa: B027 (engines without resources need no cleanup)
        """Release processes or memory the engine holds."""


def weights_for(engine: RolloutEngine, backend) -> Iterator[tuple[str, object]]:
    """The training backend's full weights as `engine` takes them: under the names it asks for,
    each cast to the dtype it holds (the one way every push, the trainer's and the device
    check's, is made)."""
    return backend.full_weights(names=engine.weight_names, dtype=engine.weight_dtype)


def _pads_exactly(model) -> bool:
    """Whether left padding leaves a row's logits its own, by the model's family
    (miles.families: Family.left_padding_exact); a model no family claims is taken as exact."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return True
    from miles.families import family_of

    written = config.to_dict()
    found = family_of(written)
    return found is None or found.left_padding_exact(found.decoder_config(written))


def _cache_measures_the_sequence(model) -> bool:
    """Whether transformers' DynamicCache for the model has an attention layer (the layers its
    get_seq_length reads); a model without a config builds its cache as it goes."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return True
    from transformers import DynamicCache
    from transformers.cache_utils import CacheLayerMixin

    layers = DynamicCache(config=config).layers
    return not layers or any(isinstance(layer, CacheLayerMixin) for layer in layers)


class TorchRolloutEngine(RolloutEngine):
    """Samples from an in-process Hugging Face causal LM.

    Distinct prompts are left-padded into one batch and prefilled once (a GRPO group of G
    samples shares its prompt's cache), and each step feeds only the new token against the
    KV cache. Finished rows are dropped from the batch and the cache, so a batch where most
    samples stop early does not keep paying for them.
    """

    name = "torch"
    # Built from a model; `from_sections` loads it from --hf-checkpoint in the trainer's
    # compute dtype (--bf16), so the engine samples what the trainer scores.

    def __init__(
        self,
        model,
        *,
        pad_token_id: int = 0,
        record_routing: bool = False,
        speculative=None,
        checkpoint: str | None = None,
    ):
        """`record_routing`: each generation carries the experts that routed its tokens
        (--use-rollout-routing-replay; miles.train.routing_replay). `speculative`
        (miles.train.speculative.SpeculativeConfig): draft with the MTP layers of `checkpoint`."""
        self.model = model.eval()
        if not _cache_measures_the_sequence(model):
            kinds = getattr(model.config, "layer_types", None)
            raise RolloutEngineError(
                f"{type(model).__name__} has no attention layer (config.layer_types {kinds}): transformers' KV "
                "cache measures a sequence by its attention layers, so decoding cannot run; use a checkpoint "
                "with at least one full-attention layer (Qwen3.5's first is its fourth)"
            )
        self.pad_token_id = pad_token_id
        self.pads_exactly = _pads_exactly(model)
        self.cache_keyword = cache_keyword(self.model)
        self.routing = None
        self.speculation = None
        if speculative is not None:
            from miles.train.speculative import MtpDrafter, SpeculationRefused, SpeculativeDecoder

            if record_routing:
                raise SpeculationRefused(
                    "--use-rollout-routing-replay with --sglang-speculative-algorithm: the built-in engine's "
                    "verifying forward routes rejected drafts too, and it records no routing per accepted "
                    "token; roll out with SGLang for both, or drop one"
                )
            drafter = MtpDrafter(self.model, checkpoint)
            self.speculation = SpeculativeDecoder(self.model, drafter, speculative, self.cache_keyword)
        if record_routing:
            from miles.train.routing_replay import router_hooks

            self.routing = router_hooks(self.model)

    @classmethod
    def from_sections(
        cls,
        *,
        checkpoint: CheckpointConfig,
        optimizer: OptimizerConfig,
        rollout: RolloutConfig,
        sglang: SGLangConfig,
        dist_info,
    ) -> TorchRolloutEngine:
        from miles.train.model import load_causal_lm, load_tokenizer, train_dtype
        from miles.train.speculative import SpeculativeConfig

        path = checkpoint.hf_checkpoint
        speculative = SpeculativeConfig.from_flags(  # by SGLang's names, as the seed's recipes give them
            sglang.sglang_speculative_algorithm,
            sglang.sglang_speculative_num_steps,
            sglang.sglang_speculative_eagle_topk,
            sglang.sglang_speculative_num_draft_tokens,
        )
        model = load_causal_lm(path, dtype=train_dtype(optimizer.bf16), device=dist_info.device)
        return cls(
            model,
            pad_token_id=load_tokenizer(path).pad_token_id or 0,
            record_routing=rollout.use_rollout_routing_replay,
            speculative=speculative,
            checkpoint=path,
        )

    @property
    def local_model(self):
        return self.model

    @property
    def holds_mtp_layers(self) -> bool:
        return self.speculation is not None

    @property
    def weight_dtype(self):
        return next(self.model.parameters()).dtype

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seed: int, control=None
    ) -> list[Generation]:
        """`control()`, when given, is asked between decoding steps: it may block (a pause), or
        answer a finish reason ("abort", "retract") that ends every unfinished row there."""
        import torch

        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("a prompt encoded to zero tokens; every prompt needs at least one")
        device = next(self.model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        lengths = sorted({len(p) for p in prompts})
        if self.pads_exactly or len(lengths) == 1:
            return self._batch(prompts, sampling, generator, device, control)
        # The model's logits move under left padding: one batch per prompt length, none padded.
        out: list[Generation | None] = [None] * len(prompts)
        for length in lengths:
            rows = [i for i, p in enumerate(prompts) if len(p) == length]
            for i, generation in zip(
                rows,
                self._batch([prompts[i] for i in rows], sampling, generator, device, control),
                strict=True,
            ):
                out[i] = generation
        return out

    def _batch(self, prompts, sampling: SamplingConfig, generator, device, control) -> list[Generation]:
        import torch

        if self.speculation is not None:
            with torch.inference_mode():
                out = self.speculation.generate(
                    [tuple(p) for p in prompts], sampling, generator, device, self.pad_token_id, control
                )
            return [
                Generation(tuple(p), tuple(t), tuple(lp), f, tuple(top) if sampling.top_logprobs else None)
                for p, t, lp, f, top in zip(prompts, *out, strict=True)
            ]
        if self.routing is None:
            with torch.inference_mode():
                return self._generate(prompts, sampling, generator, device, control)
        with torch.inference_mode(), self.routing.recording() as recording:
            return self._generate(prompts, sampling, generator, device, control, recording)

    def _generate(
        self, prompts, sampling: SamplingConfig, generator, device, control=None, recording=None
    ) -> list[Generation]:
        import torch
        from transformers import DynamicCache

        # GRPO asks for G samples of each prompt: prefill each distinct prompt once and give
        # every sample its own copy of that prompt's cache.
        distinct: dict[tuple[int, ...], int] = {}
        row_of = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        cache = DynamicCache(config=self.model.config)
        logits, attention = self._prefill(list(distinct), cache, device)
        routed = _RoutedRows(recording, list(distinct), row_of) if recording is not None else None
        rows = torch.tensor(row_of, device=device)
        select_cache_rows(cache, rows, batch=len(distinct))
        logits, attention = logits[rows], attention[rows]
        positions = attention.sum(dim=1, keepdim=True) - 1  # of the last prompt token
        stop = torch.tensor(sorted(sampling.stop_token_ids) or [-1], device=device)
        active = torch.arange(len(prompts), device=device)  # original row of each live row
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        tops: list[list[tuple]] = [[] for _ in prompts]
        finish = ["length"] * len(prompts)
        for step in range(sampling.max_response_len):
            next_ids, next_logprobs = sample_tokens(logits / sampling.temperature, sampling, generator)
            if sampling.top_logprobs:
                top = torch.log_softmax(logits / sampling.temperature, dim=-1).topk(
                    sampling.top_logprobs, dim=-1
                )
                for row, values, ids in zip(
                    active.tolist(), top.values.tolist(), top.indices.tolist(), strict=True
                ):
                    tops[row].append(tuple(zip(values, ids, strict=True)))
            done = torch.isin(next_ids, stop)
            for row, tok, lp, d in zip(
                active.tolist(), next_ids.tolist(), next_logprobs.tolist(), done.tolist(), strict=True
            ):
                tokens[row].append(tok)
                logprobs[row].append(lp)
                if d:
                    finish[row] = "stop"
            keep = (~done).nonzero().squeeze(1)
            if keep.numel() == 0 or step == sampling.max_response_len - 1:
                break
            stopped = control() if control is not None else None
            if stopped:
                for row in active[keep].tolist():
                    finish[row] = stopped
                break
            if keep.numel() < active.numel():
                # Finished rows leave the batch and the cache: no compute is spent on padding.
                select_cache_rows(cache, keep, batch=active.numel())
                active, next_ids, attention, positions = (
                    active[keep],
                    next_ids[keep],
                    attention[keep],
                    positions[keep],
                )
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            positions = positions + 1
            out = self.model(
                input_ids=next_ids.unsqueeze(1),
                attention_mask=attention,
                position_ids=positions,
                use_cache=True,
                **{self.cache_keyword: cache},
            )
            logits = out.logits[:, -1, :].float()
            if routed is not None:
                routed.fed(active.tolist())
        return [
            Generation(
                tuple(p), tuple(t), tuple(lp), f, tuple(top) if sampling.top_logprobs else None,
                routed_experts=routed.of(i) if routed is not None else None,
            )
            for i, (p, t, lp, f, top) in enumerate(zip(prompts, tokens, logprobs, finish, tops, strict=True))
        ]  # fmt: skip

    def _prefill(self, prompts: list[tuple[int, ...]], cache, device):
        """Left-padded forward of the prompts into `cache`; last-position logits and the mask."""
        import torch

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long, device=device)
        attention = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention[row, width - len(prompt) :] = 1
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_keyword: cache},
        )
        if cache.get_seq_length() != width:
            # The forward took the keyword but did not fill our cache: decoding would run blind.
            raise RolloutEngineError(
                f"{type(self.model).__name__}.forward left the KV cache passed as '{self.cache_keyword}' "
                f"holding {cache.get_seq_length()} of {width} prompt positions; this transformers version "
                "is not one the rollout engine supports (install the lane's pinned transformers)"
            )
        return out.logits[:, -1, :].float(), attention

    def rollout_metrics(self) -> dict[str, float]:
        """With speculation: the share of drafted tokens the policy accepted in the last rollout,
        and the drafts a row keeps per verifying forward of the policy."""
        spec = self.speculation
        if spec is None or not spec.proposed:
            return {}
        out = {
            "rollout/spec_accept_rate": spec.accepted / spec.proposed,
            "rollout/spec_accept_length": spec.accepted / max(1, spec.row_steps),
        }
        spec.proposed = spec.accepted = spec.row_steps = 0
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, object]]) -> None:
        import torch

        # state_dict keeps tied names (lm_head.weight beside embed_tokens.weight) that
        # named_parameters() folds away; the trainer's full state dict carries both.
        params = self.model.state_dict(keep_vars=True)
        if self.speculation is not None:  # the drafter's MTP layers (the trainer's, when it trains them)
            params = {**params, **self.speculation.drafter.named_tensors()}
        unknown = []
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = params.get(name)
                if target is None:
                    unknown.append(name)
                    continue
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        if unknown:
            raise KeyError(
                f"the rollout model has no parameter(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''}; "
                "trainer and rollout engine must load the same architecture"
            )

    def named_weights(self) -> Iterator[tuple[str, object]]:
        yield from self.model.state_dict(keep_vars=True).items()
        if self.speculation is not None:
            yield from self.speculation.drafter.named_tensors().items()


class _RoutedRows:
    """Each sampled row's routed experts as the engine feeds its tokens: its prompt's from the
    left-padded prefill, then one row per response token fed back (the last sampled one never is)."""

    def __init__(self, recording, distinct: list[tuple[int, ...]], row_of: list[int]):
        self.recording = recording
        prefill = recording.take()  # [distinct x width, layers, k], row-major
        width = max(len(p) for p in distinct)
        prefill = prefill.view(len(distinct), width, *prefill.shape[1:])
        prompts = [prefill[d, width - len(p) :] for d, p in enumerate(distinct)]
        self.parts: list[list] = [[prompts[d]] for d in row_of]

    def fed(self, rows: list[int]) -> None:
        """The last forward fed one token of each of `rows` (original row numbers, in batch order)."""
        step = self.recording.take()
        for i, row in enumerate(rows):
            self.parts[row].append(step[i : i + 1])

    def of(self, row: int):
        import torch

        return torch.cat(self.parts[row])


def select_cache_rows(cache, index, *, batch: int) -> None:
    """Keep (or repeat) rows `index` of everything per-row the cache holds, in place.

    Every cache layer of the recipes' families keeps its per-sequence state batch-first:
    keys and values, sliding windows, deepseek_v4's compressor buffers, glm_moe_dsa's
    indexer keys, inkling's convolution and recurrent states. transformers' own
    `reorder_cache` covers only keys and values in some pinned versions (deepseek_v4's
    compressor buffers in 5.19), so the rows are selected here, uniformly, for any layer.
    """
    for layer in cache.layers:
        for name, value in vars(layer).items():
            setattr(layer, name, _select_rows(value, index, batch))


def _select_rows(value, index, batch: int):
    import torch

    if torch.is_tensor(value):
        return value.index_select(0, index) if value.dim() and value.shape[0] == batch else value
    if isinstance(value, dict):
        return {k: _select_rows(v, index, batch) for k, v in value.items()}
    if isinstance(value, list):
        return [_select_rows(v, index, batch) for v in value]
    return value


def sample_tokens(logits, sampling: SamplingConfig, generator):
    """Draw one token per row from temperature-scaled `logits` with top-k/top-p truncation.

    Returns (token ids, their logprob under the untruncated tempered distribution).
    """
    import torch

    probs, log_probs = sampling_probs(logits, sampling)
    next_ids = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return next_ids, log_probs.gather(-1, next_ids.unsqueeze(1)).squeeze(1)


def sampling_probs(logits, sampling: SamplingConfig):
    """(the distribution sampling draws from: softmax of temperature-scaled `logits` [..., V]
    after top-k/top-p truncation, the untruncated log-softmax) of each row."""
    import torch

    if not torch.isfinite(logits).all():
        # torch.multinomial would fail with a traceback about probabilities; say what happened.
        raise RolloutEngineError(
            "the policy's logits are not finite while sampling: the weights diverged (see train/grad_norm "
            "and train/skipped_steps of the previous rollout; lower --lr)"
        )
    log_probs = torch.log_softmax(logits, dim=-1)
    filtered = logits
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(filtered, sampling.top_k, dim=-1).values[..., -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the top token always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    return torch.softmax(filtered, dim=-1), log_probs
