"""SGLang as the rollout engine, behind the same interface as the built-in torch engine.

GPU machines only. Engines are colocated with training: an engine of
`--rollout-num-gpus-per-engine` N GPUs serves the N training ranks on those GPUs, so
engines never overlap (the first rank of each group of N starts it, the others hand it
their prompts). Around training the engine releases its GPU memory (SGLang's memory saver,
`enable_memory_saver`) and takes it back before the weights are pushed in place through
`update_weights_from_tensor`, whose `(success, message)` is checked. `--sglang-<name> VALUE`
flags become the engine's server arguments, converted to the types SGLang declares.

Seeds: SGLang honours a request's `sampling_seed` only under
`--sglang-enable-deterministic-inference`; without it sampling is not reproducible and the
seed is not sent (the run says so at start). `random_seed` seeds the server's own RNG.
sglang is imported only when this engine is built.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from miles.train.args import SamplingConfig
from miles.train.rollout import Generation, RolloutEngine, RolloutEngineError

# A finish reason other than these means SGLang did not complete the request (an abort:
# prompt over the context length, out of memory, a request cancelled by a weight update).
NORMAL_FINISH = {"stop": "stop", "length": "length"}


class SGLangUnavailable(RuntimeError):
    """sglang is not installed or cannot run here; the message says what to use instead."""


@dataclasses.dataclass(frozen=True)
class ServerField:
    name: str
    type: Any  # the annotation SGLang declares
    default: Any


def server_fields(server_args_cls) -> dict[str, ServerField]:
    """The fields of SGLang's ServerArgs, a msgspec Struct in the pinned 0.5 line."""
    import msgspec

    try:
        fields = msgspec.structs.fields(server_args_cls)
    except TypeError as exc:
        raise SGLangUnavailable(
            f"{server_args_cls!r} is not a msgspec Struct as in sglang 0.5; install the lane's pinned sglang"
        ) from exc
    return {
        f.name: ServerField(f.name, f.type, None if f.default is msgspec.NODEFAULT else f.default)
        for f in fields
    }


def convert_value(flag: str, value, field: ServerField):
    """A CLI value (str, list of str, or True for a bare switch) as the type SGLang declares."""
    import msgspec

    candidates = [value, [value]] if isinstance(value, str) else [value]  # one value of a list field
    for candidate in candidates:
        try:
            return msgspec.convert(candidate, field.type, strict=False)
        except msgspec.ValidationError:
            continue
        except TypeError:  # a declared type msgspec cannot convert into: go by the default
            return _convert_by_default(value, field.default)
    raise SGLangUnavailable(f"{flag} {value!r}: SGLang declares {_type_name(field.type)} for '{field.name}'")


def _type_name(annotation) -> str:
    from typing import Annotated, get_args, get_origin

    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def _convert_by_default(value, default):
    """The CLI string as the type of the field's default (types msgspec cannot convert into)."""
    if isinstance(value, list):
        inner = default[0] if isinstance(default, list) and default else None
        return [_convert_by_default(v, inner) for v in value]
    if not isinstance(value, str):
        return value
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes")
    if isinstance(default, (int, float, str)):
        return type(default)(value)
    for kind in (int, float):  # no default to go by: numbers where they read as numbers
        try:
            return kind(value)
        except ValueError:
            pass
    return value


@dataclasses.dataclass(frozen=True)
class EngineSlot:
    """Where this rank's engine lives: which local GPUs it spans and which ranks it serves."""

    leader: bool  # this rank starts the engine and talks to it
    base_gpu_id: int
    group: tuple[int, ...]  # global ranks served by the engine, the leader first


def engine_slot(rank: int, local_rank: int, local_world_size: int, gpus_per_engine: int) -> EngineSlot:
    """Engines of `gpus_per_engine` GPUs tile each node's GPUs without overlap."""
    if local_world_size % gpus_per_engine:
        raise SGLangUnavailable(
            f"--rollout-num-gpus-per-engine {gpus_per_engine} does not divide the {local_world_size} GPUs "
            f"per node: engines would overlap or straddle nodes; use a divisor of {local_world_size}"
        )
    offset = local_rank % gpus_per_engine
    first = rank - offset
    return EngineSlot(offset == 0, local_rank - offset, tuple(range(first, first + gpus_per_engine)))


def server_kwargs(args, dist_info, server_args_cls, *, local_world_size: int | None = None) -> dict:
    """Engine keyword arguments: the model, this engine's GPUs, the memory saver, --sglang-*."""
    fields = server_fields(server_args_cls)
    slot = engine_slot(
        dist_info.rank,
        dist_info.local_rank,
        local_world_size or dist_info.world_size,
        args.rollout_num_gpus_per_engine,
    )
    kwargs = {
        "model_path": args.hf_checkpoint,
        "tp_size": args.rollout_num_gpus_per_engine,
        "random_seed": args.rollout_seed + dist_info.rank,
        "log_level": "error",
        # Colocated with training: memory is released while the trainer steps.
        "enable_memory_saver": True,
        "base_gpu_id": slot.base_gpu_id,
    }
    if args.sglang_mem_fraction_static is not None:
        kwargs["mem_fraction_static"] = args.sglang_mem_fraction_static
    for name, value in args.sglang_args.items():
        flag = f"--sglang-{name.replace('_', '-')}"
        field = fields.get(name)
        if field is None:
            raise SGLangUnavailable(f"{flag}: this SGLang has no server argument '{name}'")
        kwargs[name] = convert_value(flag, value, field)
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        raise SGLangUnavailable(
            f"this SGLang has no server argument(s) {unknown}; install the lane's pinned sglang"
        )
    return kwargs


def seeds_honoured(kwargs: Mapping[str, Any]) -> bool:
    """SGLang samples with a request's sampling_seed only in deterministic-inference mode."""
    return bool(kwargs.get("enable_deterministic_inference"))


def sampling_params(sampling: SamplingConfig, seed: int | None) -> dict:
    params = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_response_len,
        "stop_token_ids": list(sampling.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop token: the trainer learns to emit it
    }
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def to_generation(prompt: Sequence[int], out: Mapping[str, Any]) -> Generation:
    """One SGLang output dict as a Generation; an aborted request is an error, not a stop."""
    meta = out["meta_info"]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, Mapping) else finish
    if kind not in NORMAL_FINISH:
        raise RolloutEngineError(
            f"SGLang did not finish a request ({kind}: {finish.get('message', '') if isinstance(finish, Mapping) else ''}) "
            f"for a prompt of {len(prompt)} tokens; an unfinished sample cannot be trained on (check the prompt "
            "length against the model's context and --sglang-mem-fraction-static)"
        )
    entries = meta["output_token_logprobs"]  # (logprob, token id, text or None) per generated token
    return Generation(
        prompt_ids=tuple(prompt),
        response_ids=tuple(int(e[1]) for e in entries),
        logprobs=tuple(float(e[0]) for e in entries),
        finish_reason=NORMAL_FINISH[kind],
    )


class SGLangRolloutEngine(RolloutEngine):
    exact_weights = False  # SGLang's Qwen3 has no get_weights_by_name: the weight check uses logprobs
    weight_names = "checkpoint"  # its models' load_weights read checkpoint names

    def __init__(self, args, dist_info, *, engine_cls=None, server_args_cls=None):
        if dist_info.device == "cpu":
            raise SGLangUnavailable("--rollout-engine sglang needs a GPU; on CPU use --rollout-engine torch")
        if engine_cls is None or server_args_cls is None:
            try:
                import sglang
                from sglang.srt.server_args import ServerArgs
            except ImportError as exc:
                raise SGLangUnavailable(
                    f"--rollout-engine sglang: cannot import sglang ({exc}); install the lane's pinned stack "
                    "(requirements/<lane>.txt) or use --rollout-engine torch"
                ) from exc
            engine_cls, server_args_cls = engine_cls or sglang.Engine, server_args_cls or ServerArgs
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist_info.world_size))
        self.kwargs = server_kwargs(args, dist_info, server_args_cls, local_world_size=local_world)
        self.slot = engine_slot(
            dist_info.rank, dist_info.local_rank, local_world, args.rollout_num_gpus_per_engine
        )
        self.rank = dist_info.rank
        self.seeded = seeds_honoured(self.kwargs)
        self.engine = engine_cls(**self.kwargs) if self.slot.leader else None
        self.released = False
        self.bucket_bytes = args.update_weight_buffer_size or 512 << 20

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        if len(self.slot.group) == 1:
            return self._generate_here(prompts, sampling, seed)
        # The group's prompts go to its leader's engine; every rank gets its own answers back.
        from miles.train.distributed import all_gather_objects

        asked = all_gather_objects([list(p) for p in prompts])
        answers = None
        if self.slot.leader:
            mine = [asked[r] for r in self.slot.group]
            flat = self._generate_here([p for part in mine for p in part], sampling, seed)
            answers, start = [], 0
            for part in mine:
                answers.append(flat[start : start + len(part)])
                start += len(part)
        gathered = all_gather_objects(answers)
        leader = self.slot.group[0]
        return gathered[leader][self.slot.group.index(self.rank)]

    def _generate_here(self, prompts, sampling: SamplingConfig, seed: int) -> list[Generation]:
        if not prompts:
            return []
        self.resume_memory()
        params = sampling_params(sampling, seed if self.seeded else None)
        outputs = self.engine.generate(
            input_ids=[list(p) for p in prompts], sampling_params=params, return_logprob=True
        )
        return [to_generation(p, out) for p, out in zip(prompts, outputs, strict=True)]

    def update_weights(self, named_tensors: Iterable[tuple[str, object]]) -> None:
        """Push the weights in buckets of --update-weight-buffer-size bytes (default 512 MiB), so
        at most one bucket of full tensors is held; the KV cache is flushed with the last one.
        Every rank drains the iterator, engine or not: producing it may run collectives."""
        bucket: list[tuple[str, object]] = []
        size = 0
        if self.engine is not None:
            self.resume_memory()
        for name, tensor in named_tensors:
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size() if hasattr(tensor, "numel") else 0
            if size >= self.bucket_bytes:
                self._push(bucket, flush_cache=False)
                bucket, size = [], 0
        self._push(bucket, flush_cache=True)

    def _push(self, tensors: list, *, flush_cache: bool) -> None:
        if self.engine is None or not (tensors or flush_cache):
            return
        result = self.engine.update_weights_from_tensor(named_tensors=tensors, flush_cache=flush_cache)
        success, message = result if isinstance(result, tuple) else (result, "")
        if not success:
            raise RolloutEngineError(f"SGLang refused the weight update: {message or 'no message'}")

    def release_memory(self) -> None:
        """Free the engine's GPU memory (weights and KV cache) while the trainer steps."""
        if self.engine is not None and not self.released:
            self.engine.release_memory_occupation()
            self.released = True

    def resume_memory(self) -> None:
        if self.engine is not None and self.released:
            self.engine.resume_memory_occupation()
            self.released = False

    def named_weights(self) -> Iterator[tuple[str, object]]:
        raise NotImplementedError(
            "SGLang's model classes (Qwen3 among them) have no get_weights_by_name; "
            "the weight check compares logprobs of fixed sequences instead"
        )

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
