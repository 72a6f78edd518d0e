"""`python -m miles.ckpt`: prepare, make-tiny, validate, fp8, dequantize.

The invoke tasks `prepare-ckpt` and `make-tiny-ckpt` call these commands. Exit codes:
0 fine, 1 the checkpoint or a step failed (the message says which file and why), 2 bad
usage. Heavy imports happen inside the commands.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from miles.ckpt.errors import CheckpointError, describe_os_error, os_error_in
from miles.ckpt.plan import FAMILIES, STEPS, CheckpointPlan
from miles.exits import OneLineParser

MODEL_DIR_ENV = "MILES_MODEL_DIR"


class UsageError(Exception):
    """Bad command line; printed as one line, exit 2."""


def main(argv: list[str] | None = None) -> int:
    from miles.exits import missing_package, quiet_broken_pipe

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away: stop quietly
        return quiet_broken_pipe()
    except ModuleNotFoundError as exc:  # torch, safetensors or huggingface_hub not installed
        line = missing_package(exc, f"python -m miles.ckpt {args.command}")
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # every step writes into a temp sibling renamed into place last, so nothing is half-done
        print(
            f"interrupted: {args.command} stopped; nothing unfinished was marked done, rerun to resume",
            file=sys.stderr,
        )
        return 130
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as exc:
        cause = os_error_in(exc)
        if cause is None:
            raise
        print(f"error: {describe_os_error(cause, _write_target(args))}", file=sys.stderr)
        return 1


def _write_target(args: argparse.Namespace) -> Path:
    """Where the command writes, for naming a failed write that names no file itself."""
    for name in ("dst", "out", "model_dir", "path"):
        if getattr(args, name, None):
            return Path(getattr(args, name))
    return Path(os.environ.get(MODEL_DIR_ENV) or ".")


def _steps(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    steps = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise UsageError(f"unknown step(s) {unknown}; known: {', '.join(STEPS)}")
    return steps


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m miles.ckpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "prepare", help="run a model's checkpoint plan (resumable; a rerun skips finished steps)"
    )
    p.add_argument("--recipe", help="take the plan from miles.recipes (with --model)")
    p.add_argument("--platform", help="recipe platform overlay (cuda, rocm, cpu)")
    p.add_argument("--model", required=True, help="model name, e.g. Inkling-Small-4layer")
    p.add_argument("--family", choices=FAMILIES, help="without --recipe: the model family")
    p.add_argument("--source", help="without --recipe: tiny:<family>, a local dir, or org/name[@revision]")
    p.add_argument(
        "--model-dir", help=f"without --recipe: parent of the prepared dirs (default ${MODEL_DIR_ENV})"
    )
    p.add_argument(
        "--data-dir",
        help="with --recipe: where the fetch step puts the recipe's prompt datasets (default .miles/data)",
    )
    p.add_argument("--layers", type=int, help="without --recipe: N of the N-layer slice")
    p.add_argument("--plan-steps", help="without --recipe: the plan's steps (default: all but stage)")
    p.add_argument("--stage-dir", help="without --recipe: node-local directory for the stage step")
    p.add_argument("--allow-auto-map", action="store_true", help="accept config.json auto_map (remote code)")
    p.add_argument("--steps", help="run only these of the plan's steps, comma-separated")
    p.add_argument("--dry", action="store_true", help="print what would run; change nothing")
    p.add_argument("--workers", type=int, help="FP8 worker threads (default: all CPUs)")
    p.add_argument(
        "--scan-nan",
        type=float,
        default=1.0,
        metavar="FRACTION",
        help="validate: share of every float tensor read for NaN/Inf (default 1: all; 0: headers only)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(handler=cmd_prepare)

    p = sub.add_parser("make-tiny", help="build a tiny random checkpoint of a family's real architecture")
    p.add_argument("--family", required=True, choices=FAMILIES)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-bytes", type=int, help="largest shard size in bytes")
    p.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override: a number, or 0/1 for a switch (hidden_size=2048, tie_word_embeddings=0)",
    )
    p.set_defaults(handler=cmd_make_tiny)

    p = sub.add_parser("validate", help="check a checkpoint directory against its family's rules")
    p.add_argument("path", type=Path)
    p.add_argument("--family", required=True, choices=FAMILIES)
    p.add_argument("--layers", type=int, help="expected num_hidden_layers")
    p.add_argument("--allow-auto-map", action="store_true")
    p.add_argument(
        "--scan-nan", type=float, default=1.0, metavar="FRACTION",
        help="share of every float tensor read for NaN/Inf (default 1: all; 0: headers only)",
    )  # fmt: skip
    p.set_defaults(handler=cmd_validate)

    for name, helptext in (
        ("fp8", "block-wise e4m3 copy of a checkpoint"),
        ("dequantize", "bf16 copy of an FP8 checkpoint"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("src", type=Path)
        p.add_argument("dst", type=Path)
        p.add_argument("--workers", type=int)
        p.set_defaults(handler=cmd_convert, direction=name)
    return parser


def plan_from_args(args: argparse.Namespace) -> CheckpointPlan:
    if args.recipe:
        try:
            from miles import recipes
            from miles.recipes.models import UnknownModel
        except ImportError as exc:
            raise UsageError(
                f"--recipe needs miles.recipes ({exc}); use --family/--source/--model-dir"
            ) from exc
        given = {
            "model_dir": args.model_dir or os.environ.get(MODEL_DIR_ENV),
            "source": args.source,
            "stage_dir": args.stage_dir,
            "data_dir": args.data_dir,
        }
        try:
            recipe = recipes.load(args.recipe, platform=args.platform)
            return recipe.checkpoint_plan(args.model, **{k: v for k, v in given.items() if v})
        except (recipes.RecipeError, UnknownModel) as exc:  # an unknown recipe, model or platform
            raise UsageError(str(exc)) from None
    if args.data_dir:
        raise UsageError("--data-dir names where a recipe's datasets go; it needs --recipe")
    missing = [f"--{n}" for n in ("family", "source") if not getattr(args, n)]
    model_dir = args.model_dir or os.environ.get(MODEL_DIR_ENV)
    if not model_dir:
        missing.append(f"--model-dir (or ${MODEL_DIR_ENV})")
    if missing:
        raise UsageError(f"without --recipe, prepare needs {', '.join(missing)}")
    steps = _steps(args.plan_steps) or tuple(s for s in STEPS if s != "stage" or args.stage_dir)
    try:
        return CheckpointPlan(
            family=args.family,
            model_name=args.model,
            source=args.source,
            model_dir=str(Path(model_dir).resolve()),
            num_layers=args.layers,
            steps=steps,
            stage_dir=str(Path(args.stage_dir).resolve()) if args.stage_dir else None,
            allow_auto_map=args.allow_auto_map,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def cmd_prepare(args: argparse.Namespace) -> int:
    from miles.ckpt.pipeline import prepare

    plan = plan_from_args(args)
    result = prepare(
        plan,
        steps=_steps(args.steps),
        dry=args.dry,
        progress=not args.quiet,
        workers=args.workers,
        scan_fraction=args.scan_nan,
    )
    print(result.table())
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from miles.ckpt.tiny import make_tiny_checkpoint

    if args.layers < 1:
        raise UsageError(f"--layers {args.layers}: a checkpoint needs at least 1 layer")
    if args.shard_bytes is not None and args.shard_bytes < 1:
        raise UsageError(f"--shard-bytes {args.shard_bytes}: give a positive number of bytes")
    dims = {}
    for item in args.dim:
        key, _, value = item.partition("=")
        try:
            dims[key] = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            raise UsageError(f"--dim {item!r}: expected KEY=NUMBER (0/1 for a switch)") from None
        if not key:
            raise UsageError(f"--dim {item!r}: expected KEY=NUMBER (0/1 for a switch)")
    extra = {"shard_bytes": args.shard_bytes} if args.shard_bytes else {}
    out = make_tiny_checkpoint(args.family, args.layers, args.out, seed=args.seed, **extra, **dims)
    print(out)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from miles.ckpt.validate import validate_checkpoint

    report = validate_checkpoint(
        args.path,
        args.family,
        expect_layers=args.layers,
        allow_auto_map=args.allow_auto_map,
        scan_fraction=args.scan_nan,
    )
    print(
        f"{report.root}: valid {report.model_type}, {report.num_layers} layers, {report.tensors} tensors, {report.shards} shards"
    )
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from miles.ckpt.dequantize import convert_from_fp8
    from miles.ckpt.fp8 import convert_to_fp8
    from miles.ckpt.manifest import atomic_dir, fingerprint, write_manifest
    from miles.ckpt.progress import Progress

    convert = convert_to_fp8 if args.direction == "fp8" else convert_from_fp8
    with (
        atomic_dir(args.dst, reads=[args.src], replaces=(args.direction,)) as tmp,
        Progress(args.direction, 0) as progress,
    ):
        records = convert(args.src, tmp, workers=args.workers, progress=progress)
        write_manifest(tmp, args.direction, fingerprint(args.src), {}, records)
    print(args.dst)
    return 0
