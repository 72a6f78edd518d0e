"""The command line every recipe script shares: `prepare`, `train`, `full-train`.

    python scripts/run_inkling.py train --dry-run
    python scripts/amd/run_inkling.py full-train --num-gpus-per-node 4
    MILES_SCRIPT_MODEL=tiny python scripts/run_qwen3_4b.py train

Each argument is bound to an environment variable `MILES_SCRIPT_<ARGUMENT>` (a flag wins
over the variable, the variable over the default), and the resolved arguments are echoed as a
table with where each value came from. `--extra-args` are appended to the trainer's flags
last, so they win; `--extra-env-vars` (JSON object or `K=V ...`) merge into the job's
environment last.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace

from miles.ckpt.errors import CheckpointError
from miles.exits import OneLineParser
from miles.platform import PlatformError
from miles.recipes.launch import LaunchError, RunOptions, build_plan, format_plan, run
from miles.recipes.recipe import Recipe, RecipeError

ENV_PREFIX = "MILES_SCRIPT_"
COMMANDS = {
    "prepare": "download, validate, trim, FP8 and torch_dist conversion of the checkpoint",
    "train": "train with the prepared checkpoint",
    "full-train": "prepare, then train",
}


@dataclass(frozen=True)
class Field:
    name: str
    kind: type  # str, int or bool
    default: object
    help: str


FIELDS = (
    Field(
        "platform", str, None, "cpu | cuda | rocm (default: detected, MILES_HARDWARE_PLATFORM cross-checked)"
    ),
    Field(
        "model", str, None, "model name, <name>-<N>layer, or tiny (default: the recipe's for the platform)"
    ),
    Field("num_nodes", int, None, "nodes (default: the verified profile's)"),
    Field("num_gpus_per_node", int, None, "GPUs per node, gloo ranks on cpu (default: the profile's)"),
    Field("model_dir", str, ".miles/models", "where prepared checkpoints live (also MILES_MODEL_DIR)"),
    Field("data_dir", str, ".miles/data", "where prompt datasets live"),
    Field("output_dir", str, ".miles/runs", "where runs write checkpoints and logs"),
    Field("run_id", str, None, "run directory name (default: time and a random suffix)"),
    Field("source", str, None, "checkpoint source instead of the model's repo (repo id or local path)"),
    Field(
        "ray_address", str, None, "several nodes: the Ray cluster's dashboard (default http://127.0.0.1:8265)"
    ),
    Field("stage_dir", str, None, "node-local directory to stage the checkpoint to"),
    Field("num_rollout", int, None, "training rollouts (default: the recipe's)"),
    Field(
        "train_backend",
        str,
        None,
        "train with this backend instead of the recipe's (fsdp, ddp, megatron); off Megatron the command "
        "leaves out the recipe's Megatron options",
    ),  # fmt: skip
    Field("extra_args", str, "", "trainer flags appended last (they win)"),
    Field("extra_env_vars", str, "", "job environment merged last: JSON object or K=V ..."),
    Field("dry_run", bool, False, "print the plan and stop"),
    Field("json", bool, False, "print the plan as JSON"),
)


class ScriptError(ValueError):
    pass


def script_path(name: str, platform: str | None) -> str:
    """The recipe's script: scripts/amd/run_<name>.py for the ROCm form, else scripts/run_<name>.py."""
    return f"scripts/{'amd/' if platform == 'rocm' else ''}run_{name}.py"


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def build_parser(prog: str, fixed_platform: str | None) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument(
        "command", choices=tuple(COMMANDS), help="; ".join(f"{k}: {v}" for k, v in COMMANDS.items())
    )
    for f in FIELDS:
        if f.name == "platform" and fixed_platform:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.help} [{env_name(f.name)}]"
        if f.kind is bool:
            parser.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, type=f.kind, default=argparse.SUPPRESS, help=help_text)
    return parser


# Variables other miles commands already read for the same value (the checkpoint CLI and the
# GPU-lane preflight use MILES_MODEL_DIR); MILES_SCRIPT_<FIELD> still wins over them.
SHARED_ENV = {"model_dir": "MILES_MODEL_DIR"}


def resolve_fields(cli: Mapping[str, object], env: Mapping[str, str]) -> dict[str, tuple[object, str]]:
    """Each field's value and where it came from: the flag, MILES_SCRIPT_<FIELD> (or a shared
    variable such as MILES_MODEL_DIR), or the default."""
    out = {}
    for f in FIELDS:
        names = [env_name(f.name), *([SHARED_ENV[f.name]] if f.name in SHARED_ENV else [])]
        given = next((n for n in names if env.get(n, "") != ""), None)
        if f.name in cli:
            out[f.name] = (cli[f.name], "flag")
        elif given:
            out[f.name] = (_from_env(f, env[given], given), given)
        else:
            out[f.name] = (f.default, "default")
    return out


def _from_env(f: Field, text: str, name: str) -> object:
    if f.kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ScriptError(f"{name}={text!r} is not a boolean; use 1/0, true/false")
    if f.kind is int:
        try:
            return int(text)
        except ValueError:
            raise ScriptError(f"{name}={text!r} is not an integer") from None
    return text


def parse_env_vars(text: str) -> tuple[tuple[str, str], ...]:
    """`--extra-env-vars`: a JSON object, or whitespace-separated K=V pairs (shell quoting)."""
    text = text.strip()
    if not text:
        return ()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScriptError(f"--extra-env-vars is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ScriptError("--extra-env-vars JSON must be an object of NAME: value")
        return tuple((str(k), str(v)) for k, v in data.items())
    pairs = []
    for token in shlex.split(text):
        name, eq, value = token.partition("=")
        if not eq or not name:
            raise ScriptError(f"--extra-env-vars: {token!r} is not NAME=value (or pass a JSON object)")
        pairs.append((name, value))
    return tuple(pairs)


def default_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def echo_table(values: Mapping[str, tuple[object, str]], resolved: Mapping[str, object], out) -> None:
    """The arguments this run uses, with the source of each."""
    rows = [("argument", "value", "from")]
    for name, (value, origin) in values.items():
        if name in resolved and value is None:
            value, origin = resolved[name], "recipe profile"
        shown = "" if value is None else str(value)
        rows.append((name, shown, origin))
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    for r in rows:
        print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}".rstrip(), file=out)


def main(
    name: str,
    platform: str | None = None,
    argv: list[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run a recipe script. `platform` fixes the form (the scripts in scripts/amd/ pass "rocm");
    None dispatches on this machine's platform."""
    env = os.environ if env is None else env
    args = vars(build_parser(script_path(name, platform), platform).parse_args(argv))
    command = args.pop("command")
    try:
        return _main(name, platform, command, args, env)
    except (
        ScriptError, RecipeError, PlatformError, LaunchError, CheckpointError, NotImplementedError, ValueError
    ) as exc:  # fmt: skip
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `run_x.py train --dry-run | head`: the reader went away
        from miles.exits import quiet_broken_pipe

        return quiet_broken_pipe()


def _main(name: str, fixed: str | None, command: str, cli: dict, env: Mapping[str, str]) -> int:
    from miles.recipes import load

    values = resolve_fields(cli, env)
    value = {k: v for k, (v, _) in values.items()}
    platform = fixed or value["platform"] or _detected(env)
    recipe = load(name, platform=platform, env=env)
    if value["train_backend"]:
        recipe = recipe.on_backend(value["train_backend"])
    if value["run_id"] is None:
        values["run_id"] = (default_run_id(), "default")
        value["run_id"] = values["run_id"][0]
    options = RunOptions(
        model=value["model"],
        nodes=value["num_nodes"],
        gpus_per_node=value["num_gpus_per_node"],
        model_dir=value["model_dir"],
        data_dir=value["data_dir"],
        output_dir=value["output_dir"],
        run_id=value["run_id"],
        source=value["source"],
        stage_dir=value["stage_dir"],
        num_rollout=value["num_rollout"],
        extra_args=tuple(shlex.split(value["extra_args"])),
        extra_env=parse_env_vars(value["extra_env_vars"]),
        python=sys.executable,
        ray_address=value["ray_address"],
        workdir=os.getcwd(),  # a Ray job's ranks run here: the plan's relative paths are this directory's
    )
    profile = recipe.profile(options.model, platform, options.nodes, options.gpus_per_node)
    resolved = {"platform": platform, "model": profile.model, "num_nodes": profile.nodes}
    resolved["num_gpus_per_node"] = profile.gpus_per_node
    out = sys.stderr if value["json"] else sys.stdout
    echo_table({k: v for k, v in values.items() if not (fixed and k == "platform")}, resolved, out)
    print(file=out)
    options = _with_profile(options, profile)
    dry = value["dry_run"]
    if command in ("prepare", "full-train"):
        _prepare(recipe, options, dry, out, recipe.backend_of(profile))
        if command == "prepare":
            return 0
    plan = build_plan(recipe, options, platform, base_env=env)
    if value["json"]:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(format_plan(plan), file=out)
    if dry:
        return 0
    _check_checkpoint(plan, name, fixed)
    return run(plan, env)


def _detected(env: Mapping[str, str]) -> str:
    from miles.platform import resolve

    return str(resolve(env).platform)


def _with_profile(options: RunOptions, profile) -> RunOptions:
    return replace(options, model=profile.model, nodes=profile.nodes, gpus_per_node=profile.gpus_per_node)


def _prepare(recipe: Recipe, options: RunOptions, dry: bool, out, train_backend: str) -> None:
    from miles.ckpt.pipeline import prepare  # reads checkpoints: only `prepare` needs it

    plan = recipe.checkpoint_plan(
        options.model,
        model_dir=options.model_dir,
        source=options.source,
        stage_dir=options.stage_dir,
        train_backend=train_backend,
        data_dir=options.data_dir,
    )
    print(f"checkpoint plan: {plan.source} -> {plan.hf_dir}", file=out)
    if plan.datasets:
        print(f"  data: {', '.join(plan.datasets)} -> {plan.data_dir}", file=out)
    print(
        f"  family {plan.family}, layers {plan.num_layers or 'all'}, steps: {', '.join(plan.steps)}", file=out
    )
    print(prepare(plan, dry=dry).table(), file=out)
    print(file=out)


def _check_checkpoint(plan, name: str, fixed: str | None) -> None:
    ckpt = plan.checkpoint
    needed = [ckpt.fp8_dir if "fp8" in ckpt.steps else ckpt.hf_dir]
    if "torch_dist" in ckpt.steps:
        needed.append(ckpt.torch_dist_dir)
    missing = [d for d in needed if not os.path.isdir(d)]
    if missing:
        raise LaunchError(
            f"checkpoint {', '.join(missing)} is missing; run `python {script_path(name, fixed)} prepare --model {plan.profile.model}` "
            f"first (or full-train)"
        )
