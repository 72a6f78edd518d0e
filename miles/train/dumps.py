"""Tensor dumps for debugging (`--dumper-enable`): the training model's named tensors, per forward and
rank, written to a folder, bounded in size.

Two phases of each rollout are dumped, as the seed framework names them (radixark/miles 31f1ca961,
miles/utils/dumper_utils.py): `fwd_only`, the trainer's logprob forward, and `fwd_bwd`, the
training forward and backward. `--dumper-enable` turns both on; `--dumper-fwd-only` and
`--dumper-fwd-bwd` take KEY=VALUE pairs that override it per phase:

- `enable=0|1`: dump this phase (default: --dumper-enable);
- `filter=EXPR`: a Python expression over a tensor's tags (`name`, `layer_id`, `step`, `rank`),
  unknown tags reading None: `filter=layer_id is None or layer_id < 3`;
- `enable_model_value=0|1`, `enable_model_grad=0|1`: at the end of the phase also each parameter
  (`param__<name>`) and its gradient as the optimizer applied it (`grad__param__<name>`).

A phase of rollout k writes `<--dumper-dir>/<phase>/rollout_<k>/`, one file per tensor, named by
its tags as SGLang's dumper names them (`step=S___rank=R___dump_index=I___name=N[___layer_id=L].pt`,
so its comparator reads them): `{"value": tensor, "meta": {tags, world_rank, world_size}}`. The
tensors are each module's output (`<module path>.output`, a tuple's or mapping's tensors with
their index or key), the model's inputs by their parameter name (`input_ids`, `position_ids`, ...),
`step` counting the model's forwards in the phase (one per micro-batch). `layer_id` is the
decoder layer a module belongs to (Megatron's global layer number, 0-based, on every pipeline
stage). Each rank writes `manifest_rank=R.json` last: the files it wrote and their bytes. Once a
rank's files of the run would pass `--dumper-max-bytes`, it writes no more and its manifests say
`"truncated": true`.

Parsing is standard library only (the flags are checked without torch); dumping imports torch.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FWD_ONLY, FWD_BWD = "fwd_only", "fwd_bwd"
PHASE_OPTIONS = {FWD_ONLY: "--dumper-fwd-only", FWD_BWD: "--dumper-fwd-bwd"}
KEYS = ("enable", "filter", "enable_model_value", "enable_model_grad")
_BOOLS = {"1": True, "true": True, "0": False, "false": False}
_LAYER = re.compile(r"(?:.+\.)?layers\.(\d+)")


class DumpConfigError(ValueError):
    """A --dumper-* flag's value cannot be used; the message names the flag and the fix."""


@dataclass(frozen=True)
class PhaseDump:
    """What one phase dumps."""

    enable: bool = False
    filter: str | None = None
    enable_model_value: bool = False
    enable_model_grad: bool = False


def phase_dump(enabled: bool, option: str, pairs: Sequence[str]) -> PhaseDump:
    """The phase's settings: --dumper-enable's `enabled`, overridden by the KEY=VALUE `pairs` of `option`."""
    values: dict[str, Any] = {"enable": enabled}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in KEYS:
            raise DumpConfigError(
                f"{option} {pair!r}: expected KEY=VALUE with KEY one of {', '.join(KEYS)} "
                "(e.g. enable=1 'filter=layer_id is None or layer_id < 3')"
            )
        if key == "filter":
            try:
                compile(value, f"{option} filter", "eval")
            except SyntaxError as exc:
                raise DumpConfigError(
                    f"{option} filter={value!r} is not a Python expression: {exc.msg}"
                ) from exc
            values[key] = value
        elif value.lower() in _BOOLS:
            values[key] = _BOOLS[value.lower()]
        else:
            raise DumpConfigError(f"{option} {key}={value!r}: expected 0, 1, true or false")
    return PhaseDump(**values)


def phases_of(checks) -> dict[str, PhaseDump]:
    """Each phase's settings from the checks section's --dumper-* flags."""
    return {
        FWD_ONLY: phase_dump(checks.dumper_enable, PHASE_OPTIONS[FWD_ONLY], checks.dumper_fwd_only),
        FWD_BWD: phase_dump(checks.dumper_enable, PHASE_OPTIONS[FWD_BWD], checks.dumper_fwd_bwd),
    }


def layer_ids(modules: Mapping[str, Any]) -> dict[str, int]:
    """Module path -> the decoder layer it is or belongs to: a `layers.<i>` module's global layer
    number (Megatron's 1-based `layer_number`, counted over every pipeline stage), else `<i>`."""
    layers = {}
    for path, module in modules.items():
        match = _LAYER.fullmatch(path)
        if match:
            number = getattr(module, "layer_number", None)
            layers[path] = number - 1 if isinstance(number, int) else int(match.group(1))
    return {
        path: lid
        for path in modules
        for layer, lid in layers.items()
        if path == layer or path.startswith(layer + ".")
    }


@dataclass
class Dumper:
    """One rank's dumps of a run (see the module docstring)."""

    directory: Path
    phases: Mapping[str, PhaseDump]
    rank: int
    world_size: int
    max_bytes: int
    written: int = 0  # bytes this rank has written in the run
    truncated: bool = False
    _files: list[dict] = field(default_factory=list)
    _index: int = 0
    _step: int = -1
    _phase: PhaseDump = field(default_factory=PhaseDump)

    def wants(self, phase: str) -> bool:
        return self.phases[phase].enable

    @contextlib.contextmanager
    def phase(self, phase: str, rollout_id: int, chunks: Sequence) -> Iterator[None]:
        """Dump the forwards of the model `chunks` (nn.Modules) inside the block as `phase` of
        `rollout_id`; with enable_model_value / enable_model_grad, their parameters and gradients
        as the block leaves them."""
        settings = self.phases[phase]
        if not settings.enable:
            yield
            return
        exp = self.directory / phase / f"rollout_{rollout_id}"
        exp.mkdir(parents=True, exist_ok=True)
        for stale in exp.glob(f"*___rank={self.rank}___*.pt"):  # a rerun into the same folder
            stale.unlink()
        self._files, self._index, self._step, self._phase = [], 0, -1, settings
        handles = _hook(self, exp, chunks)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        if settings.enable_model_value or settings.enable_model_grad:
            self._step += 1
            for prefix, chunk in _prefixed(chunks):
                layers = layer_ids(dict(chunk.named_modules()))
                for name, param in chunk.named_parameters():
                    owner = name.rpartition(".")[0]
                    tags = {"layer_id": layers[owner]} if owner in layers else {}
                    if settings.enable_model_value:
                        self.dump(exp, f"param__{prefix}{name}", param.detach(), tags)
                    grad = param.grad if param.grad is not None else getattr(param, "main_grad", None)
                    if settings.enable_model_grad and grad is not None:
                        self.dump(exp, f"grad__param__{prefix}{name}", grad, tags)
        manifest = {
            "rank": self.rank,
            "files": self._files,
            "bytes": self.written,
            "truncated": self.truncated,
        }
        (exp / f"manifest_rank={self.rank}.json").write_text(json.dumps(manifest, indent=1))

    def dump(self, exp: Path, name: str, value, extra: Mapping[str, Any]) -> None:
        """Write one tensor with its tags, if the phase's filter keeps it and the bound allows."""
        import torch

        tags = {
            "step": max(self._step, 0),
            "rank": self.rank,
            "dump_index": self._index + 1,
            "name": name,
            **extra,
        }
        expr = self._phase.filter  # the user's own debugging expression, as the seed evaluates it
        if expr and not eval(expr, {"__builtins__": {}}, _NoneDefault(tags)):
            return
        value = value.detach()
        if hasattr(value, "full_tensor"):  # an FSDP2 shard: the whole tensor
            value = value.full_tensor()
        value = value.cpu().clone()
        size = value.numel() * value.element_size()
        if self.written + size > self.max_bytes:
            self.truncated = True
            return
        self._index += 1
        path = exp / ("___".join(f"{k}={v}" for k, v in tags.items()) + ".pt")
        meta = {**tags, "world_rank": self.rank, "world_size": self.world_size}
        torch.save({"value": value, "meta": meta}, path)
        self.written += size
        self._files.append({"file": path.name, "name": name, "shape": list(value.shape), "bytes": size})


class _NoneDefault(dict):
    def __missing__(self, key: str) -> None:
        return None


def _prefixed(chunks: Sequence) -> list[tuple[str, Any]]:
    """Model chunks with a name prefix each (none for a single chunk, `chunk<i>.` for virtual stages)."""
    return [("" if len(chunks) == 1 else f"chunk{i}.", c) for i, c in enumerate(chunks)]


def _hook(dumper: Dumper, exp: Path, chunks: Sequence) -> list:
    """Forward hooks on every module of the chunks; the first chunk's forward counts the step."""
    handles = []
    for c, (prefix, chunk) in enumerate(_prefixed(chunks)):
        modules = dict(chunk.named_modules())
        layers = layer_ids(modules)
        for path, module in modules.items():
            if path == "":
                hook = _inputs_hook(dumper, exp, module, counts=c == 0)
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            tags = {"layer_id": layers[path]} if path in layers else {}
            name = f"{prefix}{path}.output" if prefix or path else "output"
            handles.append(module.register_forward_hook(_output_hook(dumper, exp, name, tags)))
    return handles


def _inputs_hook(dumper: Dumper, exp: Path, module, *, counts: bool):
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        signature = None

    def hook(_module, args, kwargs):
        if counts:
            dumper._step += 1
        named = dict(kwargs)
        if signature is not None:
            with contextlib.suppress(TypeError):
                named = dict(signature.bind_partial(*args, **kwargs).arguments)
        for name, value in named.items():
            if _is_tensor(value):
                dumper.dump(exp, name, value, {})

    return hook


def _output_hook(dumper: Dumper, exp: Path, name: str, tags: Mapping[str, Any]):
    def hook(_module, _args, output):
        for key, value in _tensors(output):
            dumper.dump(exp, f"{name}.{key}" if key else name, value, tags)

    return hook


def _tensors(output) -> list[tuple[str, Any]]:
    if _is_tensor(output):
        return [("", output)]
    if isinstance(output, Mapping):
        return [(str(k), v) for k, v in output.items() if _is_tensor(v)]
    if isinstance(output, (tuple, list)):
        return [(str(i), v) for i, v in enumerate(output) if _is_tensor(v)]
    return []


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)
