"""Which flags a run's components act on, and which flags a command sets that none of them do.

A run has three components: the trainer (miles.train.trainer), the training backend chosen by
`--train-backend` and the rollout engine chosen by `--rollout-engine`. Which of them act on a
flag is declared once, on its field (`flag(by=...)`, miles.train.config.flags); a component is
built from exactly the sections holding a field it acts on. A flag has no effect in a run when
it is set and no chosen component acts on it: that follows from the declarations, with no list
of its own. Standard library only, so a recipe can ask without importing torch.

Such a flag is refused in one line (`refusal`): when a recipe's command is built
(miles.recipes.launch) and when `python -m miles.train` starts (miles.train.runtime).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from miles.train.config import FLAGS, SECTION_NAMES, TRAINER, Flag, RunConfig, SGLangConfig, flag_of

# Where each component's class lives: (module, class), by its --train-backend / --rollout-engine value.
BACKENDS: Mapping[str, tuple[str, str]] = {
    "fsdp": ("miles.train.backends.torch_dp", "TorchDPBackend"),
    "ddp": ("miles.train.backends.torch_dp", "TorchDPBackend"),
    "megatron": ("miles.train.backends.megatron", "MegatronBackend"),
}
ENGINES: Mapping[str, tuple[str, str]] = {
    "torch": ("miles.train.rollout", "TorchRolloutEngine"),
    "sglang": ("miles.train.sglang_engine", "SGLangRolloutEngine"),
}


@dataclass(frozen=True)
class Consumer:
    """One component of a run, as the flags' `by` names it."""

    name: str  # as a note names it: "the trainer", "--train-backend megatron", "the sglang rollout engine"
    kind: str  # trainer | backend | engine
    choice: str  # the --train-backend / --rollout-engine value that selects it ("trainer" for the trainer)

    def consumes(self, flag: Flag) -> bool:
        return self.choice in flag.by

    @property
    def uses(self) -> Mapping[str, frozenset[str]]:
        """Section -> the fields of it the component acts on."""
        return fields_used_by(self.choice)

    @property
    def sections(self) -> tuple[str, ...]:
        """The sections it is built from (in the order of the flag table)."""
        return tuple(s for s in SECTION_NAMES if s in self.uses)


@cache
def fields_used_by(component: str) -> Mapping[str, frozenset[str]]:
    """Section -> fields of the flags whose `by` names `component` (the sglang section's
    `server_args`, the passed-through --sglang-* options, counts with the section's flags)."""
    out: dict[str, set[str]] = {}
    for f in FLAGS:
        if component in f.by:
            out.setdefault(f.section, set()).add(f.dest)
    if component in SGLangConfig.used_by:
        out.setdefault(SGLangConfig.name, set()).add("server_args")
    return {section: frozenset(fields) for section, fields in out.items()}


def trainer() -> Consumer:
    return Consumer("the trainer", "trainer", TRAINER)


def backend(choice: str) -> Consumer:
    return Consumer(f"--train-backend {choice}", "backend", choice)


def engine(choice: str) -> Consumer:
    return Consumer(f"the {choice} rollout engine", "engine", choice)


def component_class(kind: str, choice: str) -> type:
    """The class of the backend or engine `choice` (imports its module)."""
    module, cls = (BACKENDS if kind == "backend" else ENGINES)[choice]
    return getattr(importlib.import_module(module), cls)


def build(kind: str, choice: str, config: RunConfig, dist_info, **options):
    """The backend or engine `choice`, given exactly the sections it declares (as keyword
    arguments named after them) and the process's DistInfo. A class built from something else
    than its sections (the built-in engine wraps a model) is built by its `from_sections`."""
    cls = component_class(kind, choice)
    factory = getattr(cls, "from_sections", cls)
    component = backend(choice) if kind == "backend" else engine(choice)
    sections = {name: config.section(name) for name in component.sections}
    return factory(**sections, dist_info=dist_info, **options)


def chosen(config: RunConfig, engine_choice: str) -> tuple[Consumer, ...]:
    """The run's components: the trainer, its backend, and `engine_choice` (the engine that
    --rollout-engine resolves to on the machine: torch or sglang)."""
    return trainer(), backend(config.job.train_backend), engine(engine_choice)


def flag_named(option: str) -> Flag:
    """The table entry of an option a command sets: its flag, or for a passed-through
    `--sglang-*` the sglang section's server_args."""
    return flag_of(option) or Flag(
        option, "server_args", SGLangConfig.name, {}, frozenset(SGLangConfig.used_by)
    )


def set_flags(config: RunConfig) -> list[Flag]:
    """The flags the command sets, as table entries."""
    return [flag_named(option) for option in config.flags_set]


def unconsumed(config: RunConfig, components: Iterable[Consumer]) -> list[Flag]:
    """The flags the command sets that none of `components` acts on."""
    components = tuple(components)
    return [f for f in set_flags(config) if not any(c.consumes(f) for c in components)]


def flags_without_effect(config: RunConfig, engine_choice: str) -> list[str]:
    """The options a command sets that no component of its run consumes (trainer, the
    --train-backend, and the engine `engine_choice`), in the order of the flag table."""
    return [f.option for f in unconsumed(config, chosen(config, engine_choice))]


def refusal(config: RunConfig, engine_choice: str) -> str | None:
    """One line naming every flag the command sets that its run would not act on, who would act
    on each and the fix; None when every flag acts."""
    run = f"--train-backend {config.job.train_backend} with the {engine_choice} rollout engine"
    others = [backend(c) for c in BACKENDS if c != config.job.train_backend]
    others += [engine(c) for c in ENGINES if c != engine_choice]
    by_reader: dict[str, list[str]] = {}
    for flag in unconsumed(config, chosen(config, engine_choice)):
        readers = [c for c in others if c.consumes(flag)]
        reasons = [flag.why_not] if flag.why_not else []
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
    parts = [f"--train-backend {'/'.join(backends)}"] if backends else []
    parts += [f"the {'/'.join(engines)} rollout engine"] if engines else []
    return " and ".join(parts)
