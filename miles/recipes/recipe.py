"""A training recipe as data: model, argument groups, environment, verified parallel profiles.

The shared recipe serves CUDA (and the CPU `tiny` profile); a platform's form is the shared
recipe plus a declared `Overlay` (its own profiles, rollout/attention backends, environment,
pins), applied by `for_platform()`. Nothing is copied, so `python -m miles.recipes diff`
can print every difference, and every profile is validated against the Megatron rules when
the recipe is defined: an impossible layout cannot be committed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

from miles.ckpt.datasets import UnknownDataset, dataset_of
from miles.ckpt.families import writes_megatron_keys
from miles.ckpt.plan import CheckpointPlan
from miles.parallel import InvalidParallelism, ParallelLayout, validate
from miles.recipes.args import Args, fill, merge, render
from miles.recipes.fidelity import Deviation, Reference, Rename
from miles.recipes.models import TINY, ModelSpec, ResolvedModel, resolve_model

# The argument groups, in the order they appear on the command line.
GROUPS = ("checkpoint", "rollout", "grpo", "optimizer", "rollout_engine", "perf", "misc")
SHARED = "shared"
GPU_PLATFORMS = ("cuda", "rocm")
CPU_BACKEND = "fsdp"  # the CPU trainer runs data-parallel over gloo ranks
DEFAULT_DATA_DIR = ".miles/data"


class RecipeError(ValueError):
    pass


def groups(**named: Args) -> tuple[tuple[str, Args], ...]:
    """Argument groups by name, in command-line order; an unknown group name is an error."""
    unknown = set(named) - set(GROUPS)
    if unknown:
        raise RecipeError(f"unknown argument group(s) {sorted(unknown)}; known: {', '.join(GROUPS)}")
    return tuple((g, tuple(named[g])) for g in GROUPS if g in named)


def _lookup(pairs: tuple[tuple[str, Args], ...], group: str) -> Args:
    return next((args for g, args in pairs if g == group), ())


@dataclass(frozen=True)
class ParallelProfile:
    """A layout verified for one model on (platform, nodes, GPUs per node)."""

    platform: str  # cpu | cuda | rocm
    nodes: int
    gpus_per_node: int  # on cpu: gloo ranks per node
    model: str  # the model name it was verified with ("tiny" for the CPU profile)
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    rollout_gpus_per_engine: int = 1
    rollout_engine: str = "sglang"  # sglang on GPUs; torch (the trainer's own sampler) on CPU
    overrides: tuple[tuple[str, Args], ...] = ()  # flags this profile sets or removes, by group
    suite: str | None = None  # the CI suite that runs it (checked against the catalog)
    source: str = ""  # where the layout comes from
    train_backend: str | None = None  # None: the recipe's on GPUs, fsdp on the CPU
    # Render only the flags the run's trainer, backend and engine act on: a recipe re-rendered
    # for another backend (Recipe.on_backend) leaves out what only its own backend reads.
    only_read: bool = False

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.model, self.platform, self.nodes, self.gpus_per_node)

    def describe(self) -> str:
        return f"{self.platform} {self.nodes}x{self.gpus_per_node} {self.model}: {self.parallel.describe()}"

    @property
    def gpus(self) -> bool:
        return self.platform in GPU_PLATFORMS


@dataclass(frozen=True)
class Overlay:
    """What a platform changes in the shared recipe, and why."""

    platform: str
    reason: str
    args: tuple[tuple[str, Args], ...] = ()  # merged into the shared groups (None removes a flag)
    env: tuple[tuple[str, str | None], ...] = ()  # merged into the shared environment (None removes)
    profiles: tuple[ParallelProfile, ...] = ()  # replace the shared profiles on this platform
    pins: tuple[tuple[str, str], ...] = ()  # package == version the platform's stack needs
    fp8_rollout: bool | None = None  # None: as the shared recipe
    deviations: tuple[Deviation | Rename, ...] = ()  # where this form differs from its reference, and why


@dataclass(frozen=True)
class Fallback:
    """What a recipe's GPU profiles train with while miles' Megatron backend cannot build its
    model (`miles.families` has no mapping for it), and why. It is part of the recipe,
    not of a test: the rendered command says `--train-backend <train_backend>` (FSDP: data
    parallel over the HF checkpoint on the profile's GPUs, no Megatron model or layout flags),
    `diff` explains every difference from the reference it causes with `reason`, and `list`
    shows it. A recipe whose family the backend builds may not keep one."""

    train_backend: str
    reason: str

    def deviation(self, model: ModelSpec) -> Deviation:
        """What the fallback changes against the reference's Megatron command: the backend, the
        layout, every Megatron model flag (an FSDP job reads the shape from config.json), and the
        variable miles sets for Megatron jobs only."""
        megatron = tuple(dict.fromkeys(flag for flag, _ in model.model_args()))
        keys = (
            f"--train-backend={self.train_backend}",
            "layout:*=* tp1·pp1·cp1·ep1·etp1, *",  # data parallel over the profile's GPUs
            "--megatron-*",
            "--ref-load={model_dir}/*",  # the Hugging Face dir the fallback starts from
            "env:CUDA_DEVICE_MAX_CONNECTIONS",
            *megatron,
            *_megatron_only_options(self.train_backend),
        )
        return Deviation(keys, f"fallback to --train-backend {self.train_backend}: {self.reason}")


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    model: ModelSpec
    models: tuple[str, ...]  # the model names offered; the first is the default on GPUs
    args: tuple[tuple[str, Args], ...]
    profiles: tuple[ParallelProfile, ...]
    defined_in: str  # the file to edit (shown in errors)
    fp8_rollout: bool = False  # rollout reads the FP8 checkpoint (GPU profiles)
    train_backend: str = "megatron"  # on GPUs
    env: tuple[tuple[str, str], ...] = ()
    pins: tuple[tuple[str, str], ...] = ()
    overlays: tuple[Overlay, ...] = ()
    variant: str = SHARED  # "shared", or the platform whose overlay was applied
    references: tuple[Reference, ...] = ()  # the reference commands per GPU platform (quoted facts)
    deviations: tuple[Deviation | Rename, ...] = ()  # where the recipe differs from them, and why
    fallback: Fallback | None = None  # what the GPU profiles train with while Megatron cannot build the model

    def __post_init__(self) -> None:
        unknown = [g for g, _ in self.args if g not in GROUPS]
        if unknown:
            raise RecipeError(
                f"{self.defined_in}: unknown argument group(s) {unknown}; known: {', '.join(GROUPS)}"
            )
        family = self.model.family
        if self.train_backend == "megatron" and self.fallback is None and not megatron_layout(family):
            raise RecipeError(
                f"{self.defined_in}: {self.name} trains with Megatron on GPUs, but miles' Megatron backend does "
                f"not build {family} (miles/families/); declare the recipe's Fallback (what it trains "
                "with instead, and why) or build the family"
            )
        if self.fallback is not None and megatron_layout(family):
            raise RecipeError(
                f"{self.defined_in}: {self.name} declares a fallback to {self.fallback.train_backend}, but miles' "
                f"Megatron backend builds {family} now; remove the fallback"
            )
        self.datasets()  # data the recipe names must be data something fetches
        for profile in self.profiles:
            self._check_profile(profile)

    def datasets(self) -> tuple[str, ...]:
        """The prompt datasets its GPU profiles read (miles.ckpt.datasets), fetched with the model."""
        prompt = dict(self.group("rollout")).get("--prompt-data")
        try:
            dataset = dataset_of(str(prompt)) if prompt else None
        except UnknownDataset as exc:
            raise RecipeError(f"{self.defined_in}: {exc}") from None
        return (dataset.name,) if dataset else ()

    def _check_profile(self, profile: ParallelProfile) -> None:
        where = f"{self.defined_in}: {self.name} ({self.variant}) profile {profile.platform} {profile.nodes}x{profile.gpus_per_node}"
        if profile.model != TINY and profile.model not in self.models:
            raise RecipeError(
                f"{where}: model {profile.model} is not offered ({', '.join(self.models)}, {TINY})"
            )
        if (profile.platform == "cpu") != (profile.model == TINY):
            raise RecipeError(f"{where}: the {TINY} model runs on cpu and only there (got {profile.model})")
        model = self.resolve(profile.model, env={})
        verdict = validate(
            profile.parallel,
            profile.world_size,
            model.shape,
            megatron_core=lane_megatron_core(profile.platform),
        )
        if not verdict.ok:
            raise InvalidParallelism(verdict, where)

    # --- lookups -----------------------------------------------------------------------------

    def group(self, name: str) -> Args:
        return _lookup(self.args, name)

    def resolve(self, model: str | None = None, env: Mapping[str, str] | None = None) -> ResolvedModel:
        """`model` (default: the first offered) at its depth; `env` holds MODEL_ARGS_NUM_LAYERS."""
        return resolve_model(model or self.models[0], self.model, os.environ if env is None else env)

    def for_platform(self, platform: str) -> Recipe:
        """The form of this recipe for `platform`: itself on cpu/cuda, else with that overlay."""
        platform = str(platform)
        if self.variant != SHARED:
            if platform == self.variant:
                return self
            raise RecipeError(
                f"{self.name} is the {self.variant} form; load the shared recipe for {platform}"
            )
        if platform in ("cpu", "cuda"):
            return self
        overlay = next((o for o in self.overlays if o.platform == platform), None)
        if overlay is None:
            raise RecipeError(f"{self.name} declares no {platform} overlay; add one in {self.defined_in}")
        return apply_overlay(self, overlay)

    def on_backend(self, train_backend: str) -> Recipe:
        """This recipe with every profile trained by `train_backend`. Off Megatron, at the
        data-parallel layout, and rendering only the flags that backend, the trainer and the
        engine act on: the Megatron options the recipe sets for its own backend are left out,
        not passed to be refused."""
        from miles.train.consumption import BACKENDS

        if train_backend not in BACKENDS:
            raise RecipeError(
                f"{self.name}: no train backend {train_backend!r}; known: {', '.join(BACKENDS)}"
            )
        if train_backend == "megatron":
            profiles = tuple(replace(p, train_backend=train_backend) for p in self.profiles)
        else:
            profiles = tuple(
                replace(p, train_backend=train_backend, parallel=ParallelLayout(), only_read=True)
                for p in self.profiles
            )
        return replace(self, profiles=profiles)

    def default_model(self, platform: str) -> str:
        return TINY if platform == "cpu" else self.models[0]

    def profile(
        self, model: str | None, platform: str, nodes: int | None = None, gpus_per_node: int | None = None
    ) -> ParallelProfile:
        """The profile for this model and machine shape; NotImplementedError names the defined
        ones (`python -m miles.recipes list` says which a lane has trained) and where to add one."""
        model = model or self.default_model(platform)
        for p in self.profiles:
            if (p.model, p.platform) != (model, platform):
                continue
            if nodes in (None, p.nodes) and gpus_per_node in (None, p.gpus_per_node):
                return p
        shape = f"{nodes or 'any number of'} node(s) x {gpus_per_node or 'any number of'} GPU(s)"
        defined = "; ".join(p.describe() for p in self.profiles) or "none"
        holder = "RECIPE" if self.variant == SHARED else f"the {self.variant.upper()} overlay"
        raise NotImplementedError(
            f"{self.name} ({self.variant}) has no parallel profile for {model} on {platform} with "
            f"{shape}. Defined: {defined}. To add one, put a ParallelProfile in {holder}.profiles in "
            f"{self.defined_in} (`python -m miles.parallel check --megatron` checks the layout; a run record "
            "from a lane that trained it makes it verified: `python -m miles.recipes record`)."
        )

    # --- what the recipe produces ------------------------------------------------------------

    def backend_of(self, profile: ParallelProfile) -> str:
        if profile.train_backend:
            return profile.train_backend
        if profile.platform == "cpu":
            return CPU_BACKEND
        return self.fallback.train_backend if self.fallback else self.train_backend

    def falls_back(self, profile: ParallelProfile) -> bool:
        """Whether `profile` trains with the recipe's fallback (a GPU profile of a recipe that
        declares one, with no backend of its own): it then renders only the flags its backend,
        the trainer and the engine act on, leaving out the Megatron options it would refuse."""
        return self.fallback is not None and profile.platform != "cpu" and not profile.train_backend

    def describe_profile(self, profile: ParallelProfile) -> str:
        """A profile as it trains: its layout, or for a GPU profile under the recipe's fallback the
        fallback's backend, data-parallel over the profile's GPUs (the Megatron layout it keeps for
        when the backend builds the family is named as not in use)."""
        if not self.falls_back(profile):
            return profile.describe()
        return (
            f"{profile.platform} {profile.nodes}x{profile.gpus_per_node} {profile.model}: "
            f"{self.backend_of(profile)} data-parallel over {profile.world_size} GPUs "
            f"(the fallback; its Megatron layout {profile.parallel.describe()} is unused)"
        )

    @property
    def explained(self) -> tuple[Deviation | Rename, ...]:
        """Every declared difference from the references: the fallback's first (what it changes, it
        explains), then the deviations."""
        if self.fallback is None:
            return self.deviations
        return (self.fallback.deviation(self.model), *self.deviations)

    def checkpoint_plan(
        self,
        model: str | None = None,
        *,
        model_dir: str = ".miles/models",
        source: str | None = None,
        stage_dir: str | None = None,
        env: Mapping[str, str] | None = None,
        train_backend: str | None = None,
        data_dir: str = DEFAULT_DATA_DIR,
    ) -> CheckpointPlan:
        """The checkpoint pipeline's plan for `model`: fetch and validate always; trim for an
        -Nlayer slice; fp8 for FP8-rollout recipes; torch_dist for Megatron training (the
        recipe's backend unless `train_backend` says otherwise: a fallback to FSDP needs none);
        stage when a
        node-local stage_dir is given. `tiny` builds a random checkpoint of the family locally
        (and trains on a synthetic task); any other model's fetch also fetches the prompt
        datasets the recipe reads into `data_dir`."""
        resolved = self.resolve(model, env)
        steps = ["fetch", "validate"]
        if not resolved.tiny:
            if resolved.is_slice:
                steps.append("trim")
            if self.fp8_rollout:
                steps.append("fp8")
        gpu_backend = self.fallback.train_backend if self.fallback else self.train_backend
        megatron = (train_backend or gpu_backend) == "megatron"
        if megatron and megatron_layout(resolved.spec.family) and (not resolved.tiny or train_backend):
            steps.append("torch_dist")
        if stage_dir:
            steps.append("stage")
        return CheckpointPlan(
            family=resolved.spec.family,
            model_name=resolved.name,
            source=f"tiny:{resolved.spec.family}" if resolved.tiny else (source or resolved.spec.hf_repo),
            model_dir=model_dir,
            num_layers=resolved.num_layers if (resolved.tiny or resolved.is_slice) else None,
            steps=tuple(steps),
            stage_dir=stage_dir,
            datasets=() if resolved.tiny else self.datasets(),
            data_dir=None if resolved.tiny else data_dir,
        )

    def arg_groups(
        self, profile: ParallelProfile, fields: Mapping[str, object], env: Mapping[str, str] | None = None
    ) -> tuple[tuple[str, Args], ...]:
        """The resolved flags by group for `profile` (model flags first, as group "model");
        `env` is where MODEL_ARGS_NUM_LAYERS is read (default: os.environ)."""
        backend = self.backend_of(profile)
        resolved = self.resolve(profile.model, env)
        out: list[tuple[str, Args]] = []
        if backend == "megatron":
            # a tiny model's shape is its own config.json, not the full model's widths
            model_args = () if resolved.tiny else resolved.model_args(kernels=profile.gpus)
            if model_args:
                out.append(("model", model_args))
        merged = {group: merge(self.group(group), _lookup(profile.overrides, group)) for group in GROUPS}
        # Another engine than SGLang takes none of its server flags, but the built-in engine drafts
        # with MTP layers the run trains (it holds them to take the trained ones): then it keeps the
        # speculative flags it reads.
        drafting = any(
            flag == "--enable-mtp-training" and value for args in merged.values() for flag, value in args
        )
        for group in GROUPS:
            args = merged[group]
            if group == "rollout_engine" and profile.rollout_engine == "sglang":
                args = (("--rollout-num-gpus-per-engine", profile.rollout_gpus_per_engine), *args)
            if group == "perf":
                args = (*_placement(profile, backend), *args)
            if profile.rollout_engine != "sglang":
                args = tuple(
                    (flag, value)
                    for flag, value in args
                    if not flag.startswith("--sglang-")
                    or (drafting and _engine_reads(flag, profile.rollout_engine))
                )
                if group == "rollout_engine":
                    args = (("--rollout-engine", profile.rollout_engine), *args)
            if profile.only_read or self.falls_back(profile):
                args = tuple(
                    (flag, value)
                    for flag, value in args
                    if _read(flag, value, backend, profile.rollout_engine)
                )
            out.append((group, fill(args, fields, f"{self.defined_in}: group {group}")))
        return tuple(out)

    def train_args(
        self,
        profile: ParallelProfile,
        fields: Mapping[str, object],
        extra_args: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
    ) -> tuple[str, ...]:
        """The trainer's argv: every group in order, then `extra_args` last so they win."""
        argv: list[str] = []
        for _, args in self.arg_groups(profile, fields, env):
            argv += render(args)
        return (*argv, *extra_args)

    def environment(self) -> dict[str, str]:
        return {k: v for k, v in self.env if v is not None}

    def reference_for(self, profile: ParallelProfile) -> Reference | None:
        """The reference command a profile is held to: of its platform, for its model on as many
        GPUs if there is one, else for its model, else on as many GPUs, else the platform's first."""
        mine = [r for r in self.references if r.platform == profile.platform]
        for wanted in (
            lambda r: r.model == profile.model and r.layout.gpus == profile.world_size,
            lambda r: r.model == profile.model,
            lambda r: r.layout.gpus == profile.world_size,
            lambda r: True,
        ):
            found = next((r for r in mine if wanted(r)), None)
            if found is not None:
                return found
        return None


def _engine_reads(option: str, engine: str) -> bool:
    """Whether rollout engine `engine` acts on `option` (the built-in one reads the speculative flags)."""
    from miles.train import consumption

    return consumption.engine(engine).consumes(consumption.flag_named(option))


def _read(option: str, value: object, backend: str, engine: str) -> bool:
    """Whether the trainer, `backend` or `engine` acts on `option`, or `value` is the flag's
    default, which changes nothing (miles.train.consumption counts only flags set otherwise)."""
    from miles.train import consumption

    flag = consumption.flag_named(option)
    if flag.dest != "server_args" and value == flag.default:
        return True
    components = (consumption.trainer(), consumption.backend(backend), consumption.engine(engine))
    return any(c.consumes(flag) for c in components)


def _megatron_only_options(backend: str) -> tuple[str, ...]:
    """The options the Megatron backend acts on and `backend` does not: what a fallback leaves out."""
    from miles.train import consumption
    from miles.train.config import FLAGS

    megatron, other = consumption.backend("megatron"), consumption.backend(backend)
    return tuple(f.option for f in FLAGS if megatron.consumes(f) and not other.consumes(f))


def _placement(profile: ParallelProfile, backend: str) -> Args:
    out: list = [
        ("--train-backend", backend),
        ("--actor-num-nodes", profile.nodes),
        ("--actor-num-gpus-per-node", profile.gpus_per_node),
    ]
    if backend == "megatron":
        out += profile.parallel.trainer_args()
    return tuple(out)


def apply_overlay(recipe: Recipe, overlay: Overlay) -> Recipe:
    """The shared recipe with `overlay` applied: groups and env merged, profiles replaced."""
    names = [g for g, _ in overlay.args if g not in GROUPS]
    if names:
        raise RecipeError(f"{recipe.defined_in}: {overlay.platform} overlay names unknown group(s) {names}")
    args = groups(**{g: merge(recipe.group(g), _lookup(overlay.args, g)) for g in GROUPS})
    env = dict(recipe.env)
    for key, value in overlay.env:
        env[key] = value
    pins = dict(recipe.pins) | dict(overlay.pins)
    return replace(
        recipe,
        args=args,
        env=tuple((k, v) for k, v in env.items() if v is not None),
        profiles=overlay.profiles,
        pins=tuple(pins.items()),
        variant=overlay.platform,
        fp8_rollout=recipe.fp8_rollout if overlay.fp8_rollout is None else overlay.fp8_rollout,
        deviations=(*overlay.deviations, *recipe.deviations),
    )


def gpu_profile(
    platform: str,
    nodes: int,
    gpus_per_node: int,
    model: str,
    parallel: ParallelLayout,
    *,
    rollout_gpus_per_engine: int,
    suite: str,
    source: str = "",
    **overrides: Args,
) -> ParallelProfile:
    """A GPU profile, trained in CI `suite` (a suite of this platform whose runners have this many
    GPUs: the CI holds every profile to it, `python -m miles.ci recipes`)."""
    if platform not in GPU_PLATFORMS:
        raise RecipeError(f"gpu_profile platform must be one of {GPU_PLATFORMS}, got {platform}")
    return ParallelProfile(
        platform, nodes, gpus_per_node, model, parallel, rollout_gpus_per_engine, "sglang", groups(**overrides),
        suite, source,
    )  # fmt: skip


@cache
def lane_megatron_core(platform: str) -> str | None:
    """The megatron-core release a platform's lane pins (requirements/<stack>.txt), whose
    layout rules its profiles must meet; None (the installed release) without the locks."""
    from miles.image.config import load_images
    from miles.image.pins import parse_lock

    root = Path(__file__).resolve().parents[2]
    try:
        stack = load_images().stack_of_backend(platform)
        pin = parse_lock(root / stack.lock_path).pins.get("megatron-core")
    except (OSError, ValueError, KeyError):
        return None
    return pin.version if pin else None


def source_file(module_name: str) -> str:
    """`miles.recipes.library.inkling` -> `miles/recipes/library/inkling.py` (for error messages)."""
    return module_name.replace(".", "/") + ".py"


def megatron_layout(family: str) -> bool:
    """Whether miles' Megatron backend builds this family (its torch_dist is then written in
    Megatron's own keys); for the others the torch_dist dir keeps HF names, which no Megatron
    job loads, so their recipes declare a `Fallback`."""
    return writes_megatron_keys(family)
