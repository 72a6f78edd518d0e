"""Which flags a run's components act on, and which flags a command sets that none of them do.

A run has three components: the trainer (miles.train.trainer), the training backend chosen by
`--train-backend` and the rollout engine chosen by `--rollout-engine`. Each declares what it
consumes in a `CONSUMES` literal beside its code: section name -> the fields it acts on, or
"*" for the whole section (the trainer's is a module constant, a backend's or an engine's a
class attribute; each constructor takes exactly the sections it names). A flag has no effect
in a run when it is set and no chosen component consumes its field: that follows from the
declarations, with no list of its own. The declarations are read from the source files' syntax
trees, so a recipe can ask without importing torch.

Such a flag is refused in one line (`refusal`): when a recipe's command is built
(miles.recipes.launch) and when `python -m miles.train` starts (miles.train.runtime).
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from miles.train.config import FLAGS, SECTION_NAMES, Flag, RunConfig, SGLangConfig, flag_of

ALL = "*"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # miles/

# Where each component is declared: (module, class); class None is the module's own CONSUMES.
TRAINER = ("miles.train.trainer", None)
BACKENDS: Mapping[str, tuple[str, str]] = {
    "fsdp": ("miles.train.backends.torch_dp", "TorchDPBackend"),
    "ddp": ("miles.train.backends.torch_dp", "TorchDPBackend"),
    "megatron": ("miles.train.backends.megatron", "MegatronBackend"),
}
ENGINES: Mapping[str, tuple[str, str]] = {
    "torch": ("miles.train.rollout", "TorchRolloutEngine"),
    "sglang": ("miles.train.sglang_engine", "SGLangRolloutEngine"),
}
# The engines in processes of their own (--rollout-num-gpus without --colocate), by --rollout-engine.
REMOTE_ENGINES: Mapping[str, tuple[str, str]] = {
    "torch": ("miles.train.remote.engine", "RemoteRolloutEngine"),
    "sglang": ("miles.train.remote.sglang", "RemoteSGLangEngine"),
}


def disaggregated(config: RunConfig) -> bool:
    """Training and rollout on devices of their own: --rollout-num-gpus without --colocate."""
    return bool(config.job.rollout_num_gpus) and not config.job.colocate


class DeclarationError(ValueError):
    """A CONSUMES declaration that cannot be read, or that names a section or field that does not exist."""


@dataclass(frozen=True)
class Consumer:
    """One component of a run and the section fields it acts on."""

    name: str  # as a note names it: "the trainer", "--train-backend megatron", "the sglang rollout engine"
    kind: str  # trainer | backend | engine
    choice: str  # the --train-backend / --rollout-engine value that selects it ("" for the trainer)
    uses: Mapping[str, frozenset[str] | str]  # section -> fields, or ALL

    def consumes(self, flag: Flag) -> bool:
        fields = self.uses.get(flag.section, ())
        return fields == ALL or flag.dest in fields


def source_file(module: str) -> Path:
    """The file of a miles module, found without importing it (or its package)."""
    parts = module.split(".")[1:]
    path = PACKAGE_ROOT.joinpath(*parts)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


@cache
def declared(module: str, cls: str | None) -> Mapping[str, frozenset[str] | str]:
    """The CONSUMES literal of `module`'s class `cls` (or of the module), checked against the sections."""
    path = source_file(module)
    tree = ast.parse(path.read_text(), filename=str(path))
    body = tree.body
    where = f"{path}"
    if cls is not None:
        node = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == cls), None)
        if node is None:
            raise DeclarationError(f"{path}: no class {cls}")
        body, where = node.body, f"{path}: {cls}"
    for node in body:
        if "CONSUMES" in _assigned(node) and node.value is not None:
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                raise DeclarationError(
                    f"{where}.CONSUMES (line {node.lineno}) must be a literal: {{section: (field, ...) or '*'}}"
                ) from None
            return checked_declaration(value, f"{where}.CONSUMES")
    raise DeclarationError(f"{where} declares no CONSUMES (which section fields it acts on)")


def _assigned(node: ast.stmt) -> set[str]:
    """The names a statement assigns (`X = ...` or `X: T = ...`)."""
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def checked_declaration(value: object, where: str) -> Mapping[str, frozenset[str] | str]:
    """A CONSUMES value as section -> frozenset of fields (or ALL); a section or field that
    does not exist is a DeclarationError naming `where`."""
    if not isinstance(value, dict):
        raise DeclarationError(f"{where}: must be a dict of section name -> fields or '*'")
    fields_of = {name: {f.dest for f in FLAGS if f.section == name} for name in SECTION_NAMES}
    fields_of[SGLangConfig.name].add("server_args")
    out: dict[str, frozenset[str] | str] = {}
    for section, fields in value.items():
        if section not in fields_of:
            raise DeclarationError(f"{where}: no section {section!r}; sections: {', '.join(SECTION_NAMES)}")
        if fields == ALL:
            out[section] = ALL
            continue
        unknown = sorted(set(fields) - fields_of[section])
        if isinstance(fields, str) or unknown:
            raise DeclarationError(f"{where}: section {section!r} has no field(s) {unknown or fields!r}")
        out[section] = frozenset(fields)
    return out


def trainer() -> Consumer:
    return Consumer("the trainer", "trainer", "", declared(*TRAINER))


def backend(choice: str) -> Consumer:
    return Consumer(f"--train-backend {choice}", "backend", choice, declared(*BACKENDS[choice]))


def engine(choice: str) -> Consumer:
    return Consumer(f"the {choice} rollout engine", "engine", choice, declared(*ENGINES[choice]))


def remote_engine(choice: str) -> Consumer:
    uses = declared(*REMOTE_ENGINES[choice])
    return Consumer(f"the {choice} rollout engines in processes of their own", "remote", choice, uses)


def component_class(kind: str, choice: str) -> type:
    """The class of the backend or engine `choice` (kind backend, engine or remote; imports its module)."""
    module, cls = {"backend": BACKENDS, "engine": ENGINES, "remote": REMOTE_ENGINES}[kind][choice]
    return getattr(importlib.import_module(module), cls)


def build(kind: str, choice: str, config: RunConfig, dist_info, **options):
    """The backend or engine `choice`, given exactly the sections it declares (as keyword
    arguments named after them) and the process's DistInfo. A class built from something else
    than its sections (the built-in engine wraps a model) is built by its `from_sections`."""
    cls = component_class(kind, choice)
    factory = getattr(cls, "from_sections", cls)
    sections = {name: config.section(name) for name in cls.CONSUMES}
    return factory(**sections, dist_info=dist_info, **options)


def chosen(config: RunConfig, engine_choice: str) -> tuple[Consumer, ...]:
    """The run's components: the trainer, its backend, and `engine_choice` (the engine that
    --rollout-engine resolves to on the machine: torch or sglang), in the trainer's processes or
    in processes of their own (`disaggregated`)."""
    rollout = remote_engine(engine_choice) if disaggregated(config) else engine(engine_choice)
    return trainer(), backend(config.job.train_backend), rollout


def set_flags(config: RunConfig) -> list[Flag]:
    """The flags the command sets, as table entries (a passed-through `--sglang-*` is the
    sglang section's server_args)."""
    return [
        flag_of(option) or Flag(option, "server_args", SGLangConfig.name, {}) for option in config.flags_set
    ]


def unconsumed(config: RunConfig, components: Iterable[Consumer]) -> list[Flag]:
    """The flags the command sets that none of `components` acts on."""
    components = tuple(components)
    return [f for f in set_flags(config) if not any(c.consumes(f) for c in components)]


def flags_without_effect(config: RunConfig, engine_choice: str) -> list[str]:
    """The options a command sets that no component of its run consumes (trainer, the
    --train-backend, and the engine `engine_choice`), in the order of the flag table."""
    return [f.option for f in unconsumed(config, chosen(config, engine_choice))]


# Why no component acts on a flag, where a reader would not guess it.
_IN_PROCESS = (
    "the built-in engine samples inside the trainer's processes and holds no GPU memory of its own to place or "
    "release"
)
_TRAIN_OFFLOAD = "no backend moves its weights or optimizer state off the GPU between steps yet"
WHY_NOT: Mapping[str, str] = {
    "--colocate": _IN_PROCESS,
    "--offload-rollout": _IN_PROCESS,
    "--rollout-num-gpus": "with --colocate the rollout shares the training devices (drop --colocate to give it its own)",
    "--offload": _TRAIN_OFFLOAD,
    "--offload-train": _TRAIN_OFFLOAD,
}


def refusal(config: RunConfig, engine_choice: str) -> str | None:
    """One line naming every flag the command sets that its run would not act on, who would act
    on each and the fix; None when every flag acts."""
    run = f"--train-backend {config.job.train_backend} with the {engine_choice} rollout engine"
    others = [backend(c) for c in BACKENDS if c != config.job.train_backend]
    others += [engine(c) for c in ENGINES if c != engine_choice or disaggregated(config)]
    others += [remote_engine(c) for c in REMOTE_ENGINES if c != engine_choice or not disaggregated(config)]
    by_reader: dict[str, list[str]] = {}
    for flag in unconsumed(config, chosen(config, engine_choice)):
        readers = [c for c in others if c.consumes(flag)]
        reasons = [WHY_NOT[flag.option]] if flag.option in WHY_NOT else []
        if readers:
            reasons.append(f"read by {_names(readers)}")
        by_reader.setdefault(", ".join(reasons) or "read by no component", []).append(flag.option)
    if not by_reader:
        return None
    listed = "; ".join(f"{' '.join(options)} ({who})" for who, options in by_reader.items())
    return (
        f"{listed}: no effect on {run}, so refused; drop them, or run with the backend or engine that "
        "reads them"
    )


def _names(components: Sequence[Consumer]) -> str:
    """'--train-backend fsdp/ddp' or 'the sglang rollout engine': who else acts on a flag."""
    backends = [c.choice for c in components if c.kind == "backend"]
    engines = [c.choice for c in components if c.kind == "engine"]
    remote = [c.choice for c in components if c.kind == "remote"]
    parts = [f"--train-backend {'/'.join(backends)}"] if backends else []
    parts += [f"the {'/'.join(engines)} rollout engine"] if engines else []
    parts += (
        [f"the {'/'.join(remote)} rollout engines in processes of their own (--rollout-num-gpus)"]
        if remote
        else []
    )
    return " and ".join(parts)
