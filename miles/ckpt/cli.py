"""`python -m miles.ckpt`: prepare, make-tiny, validate, fp8, dequantize.

The invoke tasks `prepare-ckpt` and `make-tiny-ckpt` call these commands (a recipe's model is
prepared by `python -m miles.recipes prepare`, which runs its plan here). Exit codes:
0 fine, 1 the checkpoint or a step failed (the message says which file and why), 2 bad
usage. Heavy imports happen inside the commands.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from miles.ckpt.errors import CheckpointError, describe_os_error, os_error_in
from miles.ckpt.plan import FAMILIES, STEPS, CheckpointPlan
from miles.exits import OneLineParser

MODEL_DIR_ENV = "MILES_MODEL_DIR"


class UsageError(Exception):
    """Bad command line; printed as one line, exit 2."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return handled(
        lambda: args.handler(args), args.command, f"python -m miles.ckpt {args.command}", _write_target(args)
    )


def handled(run: Callable[[], int], step: str, command: str, target: Path) -> int:
    """`run()`'s exit code, with every error a person can act on said in one line: bad usage 2,
    a failed step 1, an interrupt 130 (nothing unfinished was marked done), a missing package
    or a failed write (naming `target` when the error names no file) 1."""
    from miles.exits import missing_package, quiet_broken_pipe

    try:
        return run()
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away: stop quietly
        return quiet_broken_pipe()
    except ModuleNotFoundError as exc:  # torch, safetensors or huggingface_hub not installed
        line = missing_package(exc, command)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # every step writes into a temp sibling renamed into place last, so nothing is half-done
        print(
            f"interrupted: {step} stopped; nothing unfinished was marked done, rerun to resume",
            file=sys.stderr,
        )
        return 130
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as exc:
        cause = os_error_in(exc)
        if cause is None:
            raise
        print(f"error: {describe_os_error(cause, target)}", file=sys.stderr)
        return 1


def _write_target(args: argparse.Namespace) -> Path:
    """Where the command writes, for naming a failed write that names no file itself."""
    for name in ("dst", "out", "model_dir", "path"):
        if getattr(args, name, None):
            return Path(getattr(args, name))
    return Path(os.environ.get(MODEL_DIR_ENV) or ".")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give a whole number of at least 1")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: give a whole number of at least 0")
    return value


def _fraction(text: str) -> float:
    """--scan-nan: a share from 0 (headers only) to 1 (every value); NaN would scan nothing."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a fraction from 0 (headers only) to 1 (every value)"
        )
    return value


def _dim(text: str) -> tuple[str, int | float]:
    """--dim KEY=VALUE: a config key and a finite number of at least 0 (0/1 for a switch)."""
    key, _, value = text.partition("=")
    try:
        number = int(value) if value.lstrip("-").isdigit() else float(value)
    except ValueError:
        number = math.nan
    if not key or not key.isidentifier() or not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=NUMBER (0/1 for a switch)")
    if number < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size or switch is at least 0")
    return key, number


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
    p.add_argument("--recipe", help=argparse.SUPPRESS)  # refused with the command that takes it
    p.add_argument(
        "--model", required=True, help="model name, e.g. Qwen3-4B-4layer (the prepared dirs' name)"
    )
    p.add_argument("--family", choices=FAMILIES, help="the model family")
    p.add_argument("--source", help="tiny:<family>, a local dir, or org/name[@revision]")
    p.add_argument("--model-dir", help=f"parent of the prepared dirs (default ${MODEL_DIR_ENV})")
    p.add_argument("--layers", type=_positive_int, help="N of the N-layer slice")
    p.add_argument("--plan-steps", help="the plan's steps (default: all but stage)")
    p.add_argument("--stage-dir", help="node-local directory for the stage step")
    p.add_argument("--allow-auto-map", action="store_true", help="accept config.json auto_map (remote code)")
    add_run_options(p)
    p.set_defaults(handler=cmd_prepare)

    p = sub.add_parser("make-tiny", help="build a tiny random checkpoint of a family's real architecture")
    p.add_argument("--family", required=True, choices=FAMILIES)
    p.add_argument("--layers", type=_positive_int, default=4)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=_count, default=0)
    p.add_argument("--shard-bytes", type=_positive_int, help="largest shard size in bytes")
    p.add_argument(
        "--dim",
        type=_dim,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override: a number, or 0/1 for a switch (hidden_size=2048, tie_word_embeddings=0)",
    )
    p.set_defaults(handler=cmd_make_tiny)

    p = sub.add_parser("validate", help="check a checkpoint directory against its family's rules")
    p.add_argument("path", type=Path)
    p.add_argument("--family", required=True, choices=FAMILIES)
    p.add_argument("--layers", type=_positive_int, help="expected num_hidden_layers")
    p.add_argument("--allow-auto-map", action="store_true")
    p.add_argument(
        "--scan-nan", type=_fraction, default=1.0, metavar="FRACTION",
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
        p.add_argument("--workers", type=_positive_int)
        p.set_defaults(handler=cmd_convert, direction=name)
    return parser


def add_run_options(p: argparse.ArgumentParser) -> None:
    """How a plan runs, the same whoever made the plan (this command, or a recipe's)."""
    p.add_argument("--steps", help="run only these of the plan's steps, comma-separated")
    p.add_argument("--dry", action="store_true", help="print what would run; change nothing")
    p.add_argument("--workers", type=_positive_int, help="FP8 worker threads (default: all CPUs)")
    p.add_argument(
        "--scan-nan",
        type=_fraction,
        default=1.0,
        metavar="FRACTION",
        help="validate: share of every float tensor read for NaN/Inf (default 1: all; 0: headers only)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress display")


def run_prepare(plan: CheckpointPlan, args: argparse.Namespace) -> int:
    """Run `plan` as add_run_options' flags say and print its table."""
    from miles.ckpt.pipeline import prepare

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


def plan_from_args(args: argparse.Namespace) -> CheckpointPlan:
    if args.recipe:  # a recipe's plan comes from the recipes, which build on this package
        raise UsageError(
            f"--recipe: a recipe's plan is prepared by `python -m miles.recipes prepare {args.recipe} --model "
            f"{args.model}` (or `invoke prepare-ckpt --recipe {args.recipe} --model {args.model}`)"
        )
    missing = [f"--{n}" for n in ("family", "source") if not getattr(args, n)]
    model_dir = args.model_dir or os.environ.get(MODEL_DIR_ENV)
    if not model_dir:
        missing.append(f"--model-dir (or ${MODEL_DIR_ENV})")
    if missing:
        raise UsageError(
            f"prepare needs {', '.join(missing)} (a recipe's model: python -m miles.recipes prepare)"
        )
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
    return run_prepare(plan_from_args(args), args)


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from miles.ckpt.tiny import make_tiny_checkpoint

    dims = dict(args.dim)
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
