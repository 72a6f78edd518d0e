"""`python -m miles.recipes`: list, show, diff, check and snapshot the training recipes.

    python -m miles.recipes list
    python -m miles.recipes show inkling --platform rocm
    python -m miles.recipes diff inkling            # every ROCm delta from the shared recipe
    python -m miles.recipes check [NAME] [--megatron]
    python -m miles.recipes snapshot [--update]

Exit codes: 0 fine, 1 a check or snapshot found differences, 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from miles.recipes import names, shared, variants
from miles.recipes.recipe import RecipeError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m miles.recipes", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("list", help="recipes, their forms and verified profiles").set_defaults(handler=cmd_list)
    p = sub.add_parser("show", help="a recipe's models, flags by group, environment and profiles")
    p.add_argument("name")
    p.add_argument("--platform", default="cuda", help="cpu | cuda | rocm (default: cuda)")
    p.set_defaults(handler=cmd_show)
    p = sub.add_parser("diff", help="every difference between the shared recipe and its platform forms")
    p.add_argument("name")
    p.add_argument("--platform", help="only this platform's form (default: all overlays)")
    p.set_defaults(handler=cmd_diff)
    p = sub.add_parser("check", help="validate every profile's layout (and prove it with --megatron)")
    p.add_argument("name", nargs="?")
    p.add_argument("--megatron", action="store_true", help="also run megatron-core under gloo on the CPU")
    p.set_defaults(handler=cmd_check)
    p = sub.add_parser("snapshot", help="compare (or --update) the golden command/environment snapshots")
    p.add_argument("--update", action="store_true", help="rewrite the snapshot files")
    p.add_argument(
        "--dir", type=Path, default=None, help="snapshot folder (default: tests/snapshots/recipes)"
    )
    p.set_defaults(handler=cmd_snapshot)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (RecipeError, NotImplementedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def cmd_list(args: argparse.Namespace) -> int:
    for name in names():
        recipe = shared(name)
        print(f"{name}: {recipe.description}")
        for form in variants(name):
            for p in form.profiles:
                print(f"  [{form.variant}] {p.describe()}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    recipe = shared(args.name).for_platform(args.platform)
    print(f"{recipe.name} ({recipe.variant} form): {recipe.description}")
    print(f"  defined in {recipe.defined_in}")
    print(f"  models: {', '.join(recipe.models)}, tiny (cpu)   train backend: {recipe.train_backend}")
    print(f"  fp8 rollout: {'yes' if recipe.fp8_rollout else 'no'}")
    for group, args_ in recipe.args:
        print(f"  {group}:")
        for flag, value in args_:
            print(f"    {flag}" + ("" if value is True else f" {value}"))
    print("  env: " + (", ".join(f"{k}={v}" for k, v in recipe.env) or "-"))
    print("  pins: " + (", ".join(f"{k}=={v}" for k, v in recipe.pins) or "-"))
    print("  profiles:")
    for p in recipe.profiles:
        print(f"    {p.describe()}  [{p.evidence()}]")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from miles.recipes.diff import recipe_diff

    base = shared(args.name)
    overlays = [o for o in base.overlays if args.platform in (None, o.platform)]
    if not overlays:
        declared = ", ".join(o.platform for o in base.overlays) or "none"
        raise RecipeError(
            f"{base.name} declares no {args.platform or 'platform'} overlay (declared: {declared}); the shared form "
            f"serves cpu and cuda, and an overlay is added as an Overlay in {base.defined_in}"
        )
    for overlay in overlays:
        form = base.for_platform(overlay.platform)
        print(f"{base.name}: shared -> {overlay.platform} ({base.defined_in}: {overlay.platform.upper()})")
        print(f"  why: {overlay.reason}")
        for line in recipe_diff(base, form) or ["  (no differences)"]:
            print(f"  {line}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from miles.parallel import validate

    cases = []
    for name in [args.name] if args.name else names():
        for form in variants(name):
            for p in form.profiles:
                shape = form.resolve(p.model).shape
                cases.append(
                    (
                        f"{name} [{form.variant}] {p.describe()}",
                        p,
                        shape,
                        validate(p.parallel, p.world_size, shape),
                    )
                )
    proofs = [None] * len(cases)
    if args.megatron:
        from miles.parallel.megatron import Case, prove

        proofs = prove([Case(p.parallel, p.world_size, shape) for _, p, shape, _ in cases])
    bad = 0
    for (label, _, _, verdict), proof in zip(cases, proofs, strict=True):
        agrees = proof is None or proof.agrees_with(verdict)
        state = "ok" if verdict.ok and agrees else "FAIL"
        bad += state != "ok"
        suffix = "" if proof is None else f"; megatron-core: {proof.summary()}"
        print(f"{state:4} {label}{'' if verdict.ok else ': ' + verdict.summary()}{suffix}")
    return 1 if bad else 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    from miles.recipes import snapshot

    directory = args.dir or snapshot.DEFAULT_DIR
    if args.update:
        for path in snapshot.update(directory):
            print(f"wrote {path}")
        return 0
    problems = snapshot.compare(directory)
    for problem in problems:
        print(problem)
    if problems:
        print(
            "snapshots differ: review, then refresh with `python -m miles.recipes snapshot --update`",
            file=sys.stderr,
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
