"""`python -m miles.ci preflight`: check a lane's machine before any test runs (exit 3 on problems)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from miles.ci.commands.usage import UsageError
from miles.ci.machine.preflight import EXIT_PREFLIGHT, MIN_FREE_ENV, MODEL_DIR_ENV, BadSetting, preflight


def add_preflight(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lane", required=True)
    p.add_argument("--suite", action="append", default=[], help="only this suite's needs (repeatable)")
    p.add_argument(
        "--machine-only", action="store_true", help="skip the pinned-versions check (before installing)"
    )
    p.add_argument("--clean", action="store_true", help="kill processes left from an earlier job")
    p.add_argument("--model-dir", type=Path, help=f"where checkpoints go (default ${MODEL_DIR_ENV} or .)")
    p.add_argument(
        "--min-free-gb", type=float, help=f"free disk needed (default ${MIN_FREE_ENV} or per backend)"
    )
    p.set_defaults(handler=cmd_preflight)


def cmd_preflight(args: argparse.Namespace) -> int:
    try:
        problems, notes = preflight(
            args.lane,
            suites=args.suite,
            machine_only=args.machine_only,
            clean=args.clean,
            model_dir=args.model_dir,
            min_free_gb=args.min_free_gb,
        )
    except BadSetting as exc:
        raise UsageError(str(exc)) from None
    for note in notes:
        print(f"preflight: {note}")
    for problem in problems:
        print(f"preflight: {problem}", file=sys.stderr)
    if problems:
        print(
            f"preflight: lane {args.lane} cannot run here ({len(problems)} problem(s)); no test was started",
            file=sys.stderr,
        )
        return EXIT_PREFLIGHT
    scope = "machine" if args.machine_only else "machine and stack"
    print(f"preflight: lane {args.lane}: {scope} ok")
    return 0
