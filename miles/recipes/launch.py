"""Build a launch plan from a recipe (command, environment, working directories) and run it.

One node: `python -m torch.distributed.run --standalone` starts the trainer's ranks on GPUs
(NCCL/RCCL); on the CPU (gloo) `python -m miles.train.forked_ranks` forks them from one process
that has imported what they share. Several nodes: a Ray job submitted to an existing cluster (`ray job
submit` to its dashboard address; miles.recipes.ray_job places the ranks with a placement
group), whose log is streamed and whose exit code is the run's; the plan shows the `ray start`
commands that bring such a cluster up, which miles does not run. `--dry-run` in the scripts
prints the plan and stops.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from miles.ckpt.datasets import UnknownDataset, datasets_in
from miles.ckpt.plan import CheckpointPlan
from miles.files import check_name
from miles.parallel import DEVICE_MAX_CONNECTIONS, env_problems, validate
from miles.platform import job_env, require
from miles.recipes.args import render
from miles.recipes.fidelity import duplicates, pairs, twice
from miles.recipes.models import TINY
from miles.recipes.recipe import SHARED, ParallelProfile, Recipe, RecipeError, lane_megatron_core
from miles.recipes.status import profile_status

FORKED_RANKS_MODULE = "miles.train.forked_ranks"
TRAINER_MODULE = "miles.train"
RAY_JOB_MODULE = "miles.recipes.ray_job"
RAY_DASHBOARD_PORT = 8265
RAY_GCS_PORT = 6379


class LaunchError(RuntimeError):
    pass


@dataclass(frozen=True)
class RunOptions:
    """What a run needs beyond the recipe; the scripts fill it from flags and MILES_SCRIPT_*."""

    model: str | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    model_dir: str = ".miles/models"
    data_dir: str = ".miles/data"
    output_dir: str = ".miles/runs"
    run_id: str = "run"
    source: str | None = None  # checkpoint source override (a pre-sliced repo, a local path)
    stage_dir: str | None = None
    num_rollout: int | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()
    python: str = "python"
    head_address: str = "127.0.0.1"  # multi-node: the Ray head node
    ray_address: str | None = None  # multi-node: its dashboard (default http://<head_address>:8265)
    workdir: str | None = None  # multi-node: where the ranks run (the paths of the plan are relative to it)

    def __post_init__(self) -> None:
        check_name(self.run_id, what="--run-id")  # the run's folder under output_dir, never elsewhere
        for token in self.extra_args:
            if not token.isprintable():
                raise LaunchError(
                    f"--extra-args: {token.encode('unicode_escape').decode('ascii')!r} holds a control "
                    "character; a trainer flag or value is one printable word"
                )
        for flag, values in duplicates(pairs(self.extra_args)):  # which one is meant?
            raise LaunchError(f"--extra-args: {flag} {twice(values)}; give it once")
        for name, value in self.extra_env:
            check_env(name, value)


@dataclass(frozen=True)
class LaunchPlan:
    recipe: str
    variant: str
    platform: str
    model: str
    profile: ParallelProfile
    mode: str  # "torchrun" (one node) | "ray" (several nodes)
    command: tuple[str, ...]
    train_args: tuple[str, ...]  # the trainer's flags alone (what miles.train parses)
    env: tuple[tuple[str, str], ...]  # what the plan sets on top of the caller's environment
    workdirs: tuple[tuple[str, str], ...]  # role -> directory
    checkpoint: CheckpointPlan
    layout: str  # the layout check's verdict
    status: str = ""  # its status and why (miles.recipes.status)
    prelude: tuple[tuple[str, ...], ...] = ()  # commands each node runs before the job (ray)
    pins: tuple[tuple[str, str], ...] = ()
    groups: tuple[tuple[str, tuple[str, ...]], ...] = field(default=(), compare=False)  # for display

    def to_json(self) -> dict:
        return {
            "recipe": self.recipe,
            "variant": self.variant,
            "platform": self.platform,
            "model": self.model,
            "profile": f"{self.profile.nodes}x{self.profile.gpus_per_node}",
            "parallel": self.profile.parallel.to_json(),
            "mode": self.mode,
            "command": list(self.command),
            "env": dict(self.env),
            "workdirs": dict(self.workdirs),
            "prelude": [list(c) for c in self.prelude],
            "pins": dict(self.pins),
            "checkpoint": _checkpoint_json(self.checkpoint),
            "layout": self.layout,
            "status": self.status,
        }


def _checkpoint_json(plan: CheckpointPlan) -> dict:
    return {
        "family": plan.family,
        "model_name": plan.model_name,
        "source": plan.source,
        "model_dir": plan.model_dir,
        "num_layers": plan.num_layers,
        "steps": list(plan.steps),
        "stage_dir": plan.stage_dir,
        "datasets": list(plan.datasets),
        "data_dir": plan.data_dir,
    }


def build_plan(
    recipe: Recipe,
    options: RunOptions,
    platform: str | None = None,
    base_env: Mapping[str, str] | None = None,
    *,
    check: bool = True,
) -> LaunchPlan:
    """The plan for `recipe` with `options` on `platform` (default: the recipe form's own; for
    the shared form, cpu for the tiny model and cuda otherwise). Raises NotImplementedError
    for a profile that is not verified, and (with `check`) RecipeError for a recipe flag the
    pinned stack lacks or one given twice with different values (miles.recipes.stack)."""
    base = dict(os.environ if base_env is None else base_env)
    platform = str(platform or _platform(recipe, options.model))
    profile = recipe.profile(options.model, platform, options.nodes, options.gpus_per_node)
    resolved = recipe.resolve(profile.model, base)
    checkpoint = recipe.checkpoint_plan(
        profile.model,
        model_dir=options.model_dir,
        source=options.source,
        stage_dir=options.stage_dir,
        env=base,
        train_backend=recipe.backend_of(profile),
        data_dir=options.data_dir,
    )
    run_dir = f"{options.output_dir}/{options.run_id}"
    fields = _fields(recipe, profile, checkpoint, options, run_dir)
    extra = tuple(options.extra_args)
    if checkpoint.data_dir:  # the caller's eval or prompt sets under the data dir are fetched too
        try:
            named = [d for d in datasets_in(extra, checkpoint.data_dir) if d not in checkpoint.datasets]
        except UnknownDataset as exc:
            raise LaunchError(f"{recipe.name}: --extra-args {exc}") from None
        checkpoint = dataclasses.replace(checkpoint, datasets=(*checkpoint.datasets, *named))
    if options.num_rollout is not None:
        extra = ("--num-rollout", str(options.num_rollout), *extra)
    groups = recipe.arg_groups(profile, fields, base)
    train_args = recipe.train_args(profile, fields, extra, base)
    from miles.train.sglang_server import a2a_backend_problem

    backends = [train_args[i + 1] for i, a in enumerate(train_args[:-1]) if a == "--sglang-moe-a2a-backend"]
    problem = a2a_backend_problem(backends[-1] if backends else None, platform)
    if problem:
        raise LaunchError(f"{recipe.name} on {platform}: {problem}")
    if check:
        cut = len(train_args) - len(extra)
        check_command(recipe, profile, platform, train_args[:cut], extra=train_args[cut:])
    env = _env(recipe, profile, platform, base, dict(options.extra_env))
    mode = "torchrun" if profile.nodes == 1 else "ray"
    command, prelude = _command(mode, profile, train_args, env, options)
    verdict = validate(
        profile.parallel, profile.world_size, resolved.shape, megatron_core=lane_megatron_core(platform)
    )
    return LaunchPlan(
        recipe=recipe.name,
        variant=recipe.variant,
        platform=platform,
        model=resolved.name,
        profile=profile,
        mode=mode,
        command=command,
        train_args=train_args,
        env=tuple(sorted(env.items())),
        workdirs=(("run", run_dir), ("checkpoints", f"{run_dir}/checkpoints"), ("models", options.model_dir)),
        checkpoint=checkpoint,
        layout=verdict.summary(),
        status=profile_status(recipe, profile).text(),
        prelude=prelude,
        pins=recipe.pins,
        groups=tuple((g, tuple(render(a))) for g, a in groups),
    )


def check_command(
    recipe: Recipe,
    profile: ParallelProfile,
    platform: str,
    argv: tuple[str, ...],
    extra: tuple[str, ...] = (),
) -> None:
    """The recipe's own flags against the stack pinned for `platform`, then the whole command (the
    caller's `extra` args appended last, which may override the recipe's values) as
    `python -m miles.train` reads it: its own parser (exact spellings, every value by its rule)
    and what the run's backend and engine act on (a flag without effect is refused, as the
    trainer would at start). One RecipeError names every problem and whose it is."""
    from miles.recipes.stack import backend_problems, command_problems, stack_problems
    from miles.train.args import ArgsError, parse_config
    from miles.train.consumption import refusal

    where = f"{recipe.name} ({recipe.variant} form) {profile.describe()}"
    problems = command_problems(argv, platform, recipe.backend_of(profile))
    if problems:
        listed = "; ".join(f"{flag}: {problem}" for flag, problem in problems)
        raise RecipeError(f"{where}: {listed}. Fix the recipe in {recipe.defined_in}")
    fix = (
        f"Fix the recipe in {recipe.defined_in}"
        if not extra
        else "Fix what the command line adds (--extra-args, --num-rollout)"
    )
    if extra:
        found = stack_problems(extra, platform) + backend_problems(
            extra, platform, recipe.backend_of(profile)
        )
        if found:
            listed = "; ".join(f"{flag}: {problem}" for flag, problem in found)
            raise RecipeError(f"--extra-args of {where}: {listed}")
    # what python -m miles.train would refuse at start, said when the command is built
    try:
        config = parse_config([*argv, *extra], raising=True)
    except ArgsError as exc:
        raise RecipeError(f"{where}: python -m miles.train refuses the command: {exc}. {fix}") from None
    # the engine the command runs: an --extra-args --rollout-engine overrides the profile's
    chosen = config.job.rollout_engine
    refused = refusal(config, profile.rollout_engine if chosen == "auto" else chosen)
    if refused:
        raise RecipeError(f"{where} on the {platform} lane: {refused}. {fix}")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_env(name: str, value: str) -> None:
    """A job variable: a shell-safe name and a value of printable characters (a newline would split
    the variable the dry run prints and hand the job another one)."""
    if not _ENV_NAME.fullmatch(name):
        raise LaunchError(f"--extra-env-vars: {name!r} is not a variable name (letters, digits and _)")
    if not value.isprintable():
        shown = value.encode("unicode_escape").decode("ascii")
        raise LaunchError(
            f"--extra-env-vars: {name}={shown!r} holds a control character; a job variable's value is one line"
        )


def _platform(recipe: Recipe, model: str | None) -> str:
    if recipe.variant != SHARED:
        return recipe.variant
    return "cpu" if model in (None, TINY) else "cuda"


def _fields(
    recipe: Recipe, profile: ParallelProfile, ckpt: CheckpointPlan, options: RunOptions, run_dir: str
) -> dict:
    megatron = recipe.backend_of(profile) == "megatron"
    fp8 = recipe.fp8_rollout and "fp8" in ckpt.steps
    return {
        "hf_checkpoint": ckpt.fp8_dir if fp8 else ckpt.hf_dir,
        "hf_dir": ckpt.hf_dir,
        # a family without a Megatron layout plans no torch_dist: the trainer loads the HF dir
        "ref_load": ckpt.torch_dist_dir if megatron and "torch_dist" in ckpt.steps else ckpt.hf_dir,
        "torch_dist_dir": ckpt.torch_dist_dir,
        "save_dir": f"{run_dir}/checkpoints",
        "run_dir": run_dir,
        "model_dir": options.model_dir,
        "data_dir": options.data_dir,
        "run_id": options.run_id,
        "model_name": ckpt.model_name,
        "nodes": profile.nodes,
        "gpus_per_node": profile.gpus_per_node,
        "world_size": profile.world_size,
        "rollout_gpus_per_engine": profile.rollout_gpus_per_engine,
    }


def _env(
    recipe: Recipe, profile: ParallelProfile, platform: str, base: dict[str, str], extra: dict[str, str]
) -> dict[str, str]:
    """What the job's environment adds to or changes in `base`: the recipe's, the platform's
    device settings, Megatron's on GPUs, then `extra` last so it wins (unless it breaks a
    setting the layout needs: that is refused)."""
    full = job_env(platform, {**base, **recipe.environment()})
    if platform == "cpu":
        full.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores; one thread each
    elif recipe.backend_of(profile) == "megatron":
        # One hardware queue keeps Megatron's communication kernels ordered; Megatron-LM
        # requires it for tp > 1 or cp > 1, and the reference launcher sets it for every
        # Megatron job.
        full[DEVICE_MAX_CONNECTIONS] = "1"
    full.update(extra)
    if platform != "cpu" and recipe.backend_of(profile) == "megatron":
        problems = env_problems(profile.parallel, full)
        if problems:
            raise LaunchError(f"{recipe.name}: " + "; ".join(problems) + " (drop it from --extra-env-vars)")
    return {k: v for k, v in full.items() if base.get(k) != v}


def _command(
    mode: str, profile: ParallelProfile, train_args: tuple[str, ...], env: dict, options: RunOptions
) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """The command that starts the job, and the commands each node runs first (Ray only)."""
    trainer = (options.python, "-m", TRAINER_MODULE, *train_args)
    if mode == "torchrun":
        if options.ray_address:
            raise LaunchError(
                f"--ray-address {options.ray_address}: a one-node run starts under torchrun here, not on a Ray "
                "cluster; drop --ray-address, or give --num-nodes above 1"
            )
        if profile.platform == "cpu":
            # gloo ranks on one machine: forked after the imports they share (miles.train.forked_ranks)
            launcher = (options.python, "-m", FORKED_RANKS_MODULE)
        else:
            launcher = (options.python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1")
        return (
            *launcher,
            "--nproc-per-node",
            str(profile.gpus_per_node),
            "-m",
            TRAINER_MODULE,
            *train_args,
        ), ()
    head = options.head_address
    gpus = str(profile.gpus_per_node)
    prelude = (
        ("ray", "start", "--head", "--node-ip-address", head, "--port", str(RAY_GCS_PORT), "--num-gpus", gpus,
         "--disable-usage-stats"),
        ("ray", "start", "--address", f"{head}:{RAY_GCS_PORT}", "--num-gpus", gpus, "--disable-usage-stats"),
    )  # fmt: skip
    address = options.ray_address or f"http://{head}:{RAY_DASHBOARD_PORT}"
    submit = (
        "ray", "job", "submit", "--address", address,
        "--runtime-env-json", json.dumps({"env_vars": env}, sort_keys=True), "--",
    )  # fmt: skip
    job = (
        options.python, "-m", RAY_JOB_MODULE, "--nodes", str(profile.nodes), "--procs-per-node", gpus,
        "--gpus-per-node", "0" if profile.platform == "cpu" else gpus,
        *(("--workdir", options.workdir) if options.workdir else ()), "--",
    )  # fmt: skip
    return (*submit, *job, *trainer), prelude


def format_plan(plan: LaunchPlan) -> str:
    """The plan for people: what runs, where, with which layout, environment and flags."""
    p = plan.profile
    lines = [
        f"recipe     {plan.recipe} ({plan.variant} form)",
        f"platform   {plan.platform}, {p.nodes} node(s) x {p.gpus_per_node} {'rank' if plan.platform == 'cpu' else 'GPU'}(s), {plan.mode}",
        f"model      {plan.model}",
        f"layout     {plan.layout}",
        f"profile    {plan.status}",
        f"checkpoint {plan.checkpoint.source} -> {plan.checkpoint.hf_dir} (steps: {', '.join(plan.checkpoint.steps)})",
        *(
            [f"data       {', '.join(plan.checkpoint.datasets)} -> {plan.checkpoint.data_dir} (with the fetch step)"]
            if plan.checkpoint.datasets
            else []
        ),
    ]  # fmt: skip
    if plan.pins:
        lines.append("pins       " + ", ".join(f"{k}=={v}" for k, v in plan.pins))
    lines.append("workdirs")
    lines += [f"  {role:<12}{path}" for role, path in plan.workdirs]
    lines.append("environment (set on top of the caller's)")
    lines += [f"  {k}={v}" for k, v in plan.env] or ["  (nothing)"]
    for i, cmd in enumerate(plan.prelude):
        lines.append(f"node setup {'(head)' if i == 0 else '(each other node)'}")
        lines.append("  " + shlex.join(cmd))
    shown = [(g, flags) for g, flags in plan.groups if flags]
    extra = plan.train_args[sum(len(f) for _, f in plan.groups) :]
    if extra:
        shown.append(("extra_args", extra))
    lines.append("arguments (extra_args come last, so they win)")
    lines += [f"  {group:<15}{shlex.join(flags)}" for group, flags in shown]
    launcher = plan.command[: len(plan.command) - len(plan.train_args)]
    lines.append("command")
    body = [shlex.join(launcher)] + [f"  {shlex.join(flags)}" for _, flags in shown]
    lines += ["  " + line + (" \\" if i < len(body) - 1 else "") for i, line in enumerate(body)]
    return "\n".join(lines)


def run(plan: LaunchPlan, env: Mapping[str, str] | None = None) -> int:
    """Run a plan: one node, check the machine and the pins, make the directories, start the
    command with the plan's environment on top of `env`; several nodes, submit it to the Ray
    cluster (miles.recipes.ray_submit). Returns its exit status."""
    base = dict(os.environ if env is None else env)
    if plan.mode != "torchrun":
        from miles.recipes.ray_submit import submit

        for _, path in plan.workdirs:
            os.makedirs(path, exist_ok=True)
        return submit(plan, base)
    if plan.platform != "cpu":
        require(plan.platform, plan.profile.gpus_per_node, env=base)
    check_pins(plan.pins)
    for _, path in plan.workdirs:
        os.makedirs(path, exist_ok=True)
    return subprocess.run(list(plan.command), env={**base, **dict(plan.env)}, check=False).returncode


def check_pins(pins: tuple[tuple[str, str], ...]) -> None:
    """Every pinned package installed at its pinned version, or one error naming them all."""
    from importlib.metadata import PackageNotFoundError, version

    wrong = []
    for name, wanted in pins:
        try:
            found = version(name)
        except PackageNotFoundError:
            found = "not installed"
        if found != wanted:
            wrong.append(f"{name}=={wanted} (found {found})")
    if wrong:
        raise LaunchError(
            "pinned packages missing or at another version: "
            + ", ".join(wrong)
            + "; install the lane's requirements"
        )
