"""SGLang's server arguments for a colocated engine, and where each engine lives.

`--sglang-<name> VALUE` flags become fields of sglang's `ServerArgs` (a msgspec Struct in the
pinned 0.5 line), converted to the types it declares; an unknown name or a value of the wrong
type is refused naming the flag. Engines of `--rollout-num-gpus-per-engine` GPUs tile each
node's GPUs. Nothing here imports sglang: the caller passes its ServerArgs class.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import threading
from collections.abc import Mapping
from typing import Any

from miles.train.config import SGLangConfig

# Set when an engine process sends this one SIGQUIT (sglang's signal that a child failed).
CHILD_FAILED = threading.Event()


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


# SGLang's MoE all-to-all backends that exist on one GPU vendor only: MoRI is AMD's ROCm library
# (sglang 0.5.23's token_dispatcher/moriep.py imports the `mori` package, built for ROCm), so a
# CUDA run that names it fails inside the engine's start, after the GPUs are allocated.
VENDOR_ONLY_A2A = {"mori": ("rocm", "deepep (with --sglang-deepep-mode auto) on NVIDIA GPUs")}


def a2a_backend_problem(backend: str | None, platform: str) -> str | None:
    """Why `--sglang-moe-a2a-backend backend` cannot run on `platform` ("cuda", "rocm", "cpu"), or None."""
    wanted = VENDOR_ONLY_A2A.get(str(backend)) if backend is not None else None
    if wanted is None or platform in (wanted[0], "cpu"):
        return None
    return (
        f"--sglang-moe-a2a-backend {backend}: MoRI, the all-to-all library SGLang's {backend} dispatcher imports, "
        f"exists for AMD GPUs (ROCm) only and this is a {platform} run; use --sglang-moe-a2a-backend {wanted[1]}"
    )


def server_kwargs(
    sglang: SGLangConfig,
    dist_info,
    server_args_cls,
    *,
    model_path: str,
    seed: int,
    local_world_size: int | None = None,
) -> dict:
    """Engine keyword arguments: the model, this engine's GPUs and seed (`seed` + rank), the
    memory saver, the SGLang section's options and its --sglang-* server arguments."""
    fields = server_fields(server_args_cls)
    slot = engine_slot(
        dist_info.rank,
        dist_info.local_rank,
        local_world_size or dist_info.world_size,
        sglang.rollout_num_gpus_per_engine,
    )
    kwargs = {
        "model_path": model_path,
        "tp_size": sglang.rollout_num_gpus_per_engine,
        "random_seed": seed + dist_info.rank,
        "log_level": "error",
        # Colocated with training: memory is released while the trainer steps.
        "enable_memory_saver": True,
        "base_gpu_id": slot.base_gpu_id,
        # sglang's default kills this whole process tree when a child fails during launch
        "custom_sigquit_handler": engine_child_failed,
    }
    if sglang.sglang_mem_fraction_static is not None:
        kwargs["mem_fraction_static"] = sglang.sglang_mem_fraction_static
    for name in ("algorithm", "num_steps", "eagle_topk", "num_draft_tokens"):
        value = getattr(sglang, f"sglang_speculative_{name}")
        if value is not None:  # checked against this SGLang's ServerArgs below, like every field
            kwargs[f"speculative_{name}"] = value
    for name, value in sglang.server_args.items():
        flag = f"--sglang-{name.replace('_', '-')}"
        field = fields.get(name)
        if field is None:
            raise SGLangUnavailable(f"{flag}: this SGLang has no server argument '{name}'")
        kwargs[name] = convert_value(flag, value, field)
    from miles.platform import detect

    problem = a2a_backend_problem(kwargs.get("moe_a2a_backend"), detect().platform.value)
    if problem:
        raise SGLangUnavailable(problem)
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        raise SGLangUnavailable(
            f"this SGLang has no server argument(s) {unknown}; install the lane's pinned sglang"
        )
    return kwargs


def engine_child_failed(signum=None, frame=None) -> None:
    """SIGQUIT from an engine process while the engine starts: remembered; Engine() then raises
    (sglang's _wait_for_scheduler_ready) and the next engine call reports it. Module-level so the
    server arguments, which sglang pickles into its processes, can carry it."""
    CHILD_FAILED.set()


def require_memory_saver() -> None:
    """The colocated engine frees its GPU memory between rollouts through torch-memory-saver;
    sglang raises ImportError at launch without it, after the model load."""
    if importlib.util.find_spec("torch_memory_saver") is None:
        raise SGLangUnavailable(
            "--rollout-engine sglang: torch-memory-saver is not installed, and the engine shares its GPUs with "
            "training (it frees its memory between rollouts through it); install the lane's pinned stack "
            "(requirements/<lane>.txt) or use the lane's image"
        )


def seeds_honoured(kwargs: Mapping[str, Any]) -> bool:
    """SGLang samples with a request's sampling_seed only in deterministic-inference mode."""
    return bool(kwargs.get("enable_deterministic_inference"))
