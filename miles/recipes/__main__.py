"""`python -m miles.recipes`: list, show, diff, facts, check, record and snapshot the recipes.

    python -m miles.recipes list                    # recipes, profiles and their status
    python -m miles.recipes show inkling --platform rocm
    python -m miles.recipes diff inkling            # ROCm deltas, then each form beside its reference
    python -m miles.recipes facts inkling           # the model's config.json beside the Megatron flags
    python -m miles.recipes check [NAME] [--megatron]
    python -m miles.recipes record NAME --run-json .miles/reports/<lane>/run.json [--platform P --gpus N]
    python -m miles.recipes prepare inkling --model Inkling-Small-4layer [--steps fetch,validate] [--dry]
    python -m miles.recipes snapshot [--update]
    python -m miles.recipes references [--check | --update] --mirror PATH [--branch main]

Exit codes: 0 fine, 1 a check, diff, facts table or snapshot found a problem, 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from miles.ckpt.cli import add_run_options
from miles.exits import OneLineParser
from miles.recipes import names, shared, variants
from miles.recipes.recipe import RecipeError


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m miles.recipes", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    sub.add_parser("list", help="recipes, their forms, profiles and status").set_defaults(handler=cmd_list)
    p = sub.add_parser("show", help="a recipe's models, flags by group, environment and profiles")
    p.add_argument("name")
    p.add_argument("--platform", default="cuda", help="cpu | cuda | rocm (default: cuda)")
    p.set_defaults(handler=cmd_show)
    p = sub.add_parser(
        "diff",
        help="the platform forms' deltas, and every difference from the reference recipes, with reasons",
    )
    p.add_argument("name", nargs="?", help="one recipe (default: all)")
    p.add_argument("--platform", help="only this platform's form (cuda = the shared form, rocm, ...)")
    p.set_defaults(handler=cmd_diff)
    p = sub.add_parser("facts", help="the model's published config.json beside the recipe's Megatron flags")
    p.add_argument("name", nargs="?", help="one recipe (default: all)")
    p.set_defaults(handler=cmd_facts)
    p = sub.add_parser("record", help="record that a lane trained a profile, from the runner's run.json")
    p.add_argument("name")
    p.add_argument("--run-json", type=Path, required=True, help="run.json of the CI runner (its report dir)")
    p.add_argument("--platform", default="cpu", help="cpu | cuda | rocm (default: cpu)")
    p.add_argument("--model", help="the profile's model (default: the platform's)")
    p.add_argument("--gpus", type=int, help="GPUs (ranks on cpu) per node of the profile")
    p.add_argument("--nodes", type=int, help="nodes of the profile")
    p.add_argument("--dir", type=Path, default=None, help="where records go (default: miles/recipes/runs)")
    p.set_defaults(handler=cmd_record)
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
    p = sub.add_parser(
        "prepare",
        help="prepare a model's checkpoints and data on the recipe's plan (python -m miles.ckpt runs it)",
    )
    p.add_argument("name")
    p.add_argument("--model", required=True, help="the recipe's model, an -Nlayer slice of it, or tiny")
    p.add_argument("--platform", help="the recipe's form: cpu | cuda | rocm (default: this machine's)")
    p.add_argument(
        "--model-dir", help="parent of the prepared dirs (default: the recipe's, or $MILES_MODEL_DIR)"
    )
    p.add_argument(
        "--source", help="instead of the model's repo: tiny:<family>, a local dir, or org/name[@revision]"
    )
    p.add_argument("--stage-dir", help="node-local directory for the stage step")
    p.add_argument(
        "--data-dir", help="where the fetch step puts the recipe's prompt datasets (default .miles/data)"
    )
    add_run_options(p)
    p.set_defaults(handler=cmd_prepare)
    p = sub.add_parser(
        "references", help="list the reference readings; --check re-reads every one from a mirror of upstream"
    )
    p.add_argument("name", nargs="?", help="one recipe (default: all)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--check", action="store_true", help="fail on any quoted value the mirror does not give"
    )
    mode.add_argument("--update", action="store_true", help="rewrite the quoted values from the mirror")
    p.add_argument("--mirror", type=Path, help="a git clone or mirror of radixark/miles (full history)")
    p.add_argument(
        "--branch", default="main", help="the branch every cited commit must be on (default: main)"
    )
    p.set_defaults(handler=cmd_references)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (RecipeError, NotImplementedError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def cmd_list(args: argparse.Namespace) -> int:
    from miles.recipes.status import profile_status

    for name in names():
        recipe = shared(name)
        print(f"{name}: {recipe.description}")
        for form in variants(name):
            for p in form.profiles:
                print(f"  [{form.variant}] {form.describe_profile(p)}  ({profile_status(form, p).kind})")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    recipe = shared(args.name).for_platform(args.platform)
    print(f"{recipe.name} ({recipe.variant} form): {recipe.description}")
    print(f"  defined in {recipe.defined_in}")
    backend = recipe.train_backend
    if recipe.fallback is not None:
        backend = f"{recipe.fallback.train_backend} (fallback from {backend}: {recipe.fallback.reason})"
    print(f"  models: {', '.join(recipe.models)}, tiny (cpu)   train backend: {backend}")
    print(f"  fp8 rollout: {'yes' if recipe.fp8_rollout else 'no'}")
    for group, args_ in recipe.args:
        print(f"  {group}:")
        for flag, value in args_:
            print(f"    {flag}" + ("" if value is True else f" {value}"))
    print("  env: " + (", ".join(f"{k}={v}" for k, v in recipe.env) or "-"))
    print("  pins: " + (", ".join(f"{k}=={v}" for k, v in recipe.pins) or "-"))
    print("  profiles:")
    from miles.recipes.status import profile_status

    for p in recipe.profiles:
        print(f"    {recipe.describe_profile(p)}")
        print(f"      {profile_status(recipe, p).text()}")
    for gap in recipe.model.gaps:
        print(f"  megatron-core lacks: {gap.feature}: {gap.why}")
    for what, why in recipe.model.known_differences:
        print(f"  trainer vs rollout engine: {what}: {why}")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from miles.recipes.diff import recipe_diff, reference_comparisons

    unexplained = 0
    for name in [args.name] if args.name else names():
        base = shared(name)
        platforms = [args.platform] if args.platform else ["cuda", *(o.platform for o in base.overlays)]
        for platform in platforms:
            form = base.for_platform(platform)
            if form is not base:
                print(f"{base.name}: shared -> {platform} ({base.defined_in}: {platform.upper()})")
                print(f"  why: {next(o.reason for o in base.overlays if o.platform == platform)}")
                for line in recipe_diff(base, form) or ["  (no differences)"]:
                    print(f"  {line}")
            compared = reference_comparisons(form, platform)
            if not compared:
                print(f"{base.name} [{form.variant}] on {platform}: no reference recipe recorded")
            for item in compared:
                ref = item.comparison.reference
                print(f"{base.name} [{form.variant}] {form.describe_profile(item.profile)}")
                if form.fallback is not None:
                    print(
                        f"  fallback: --train-backend {form.fallback.train_backend} ({form.fallback.reason})"
                    )
                print(f"  beside {ref.script} on {ref.source.hardware}: {ref.source.command_line()}")
                print(f"  = {item.comparison.agree} flags, variables and layouts agree")
                for line in item.comparison.lines:
                    print(f"  {line.render()}")
                unexplained += len(item.unexplained)
    if unexplained:
        print(
            f"{unexplained} difference(s) from the reference are UNEXPLAINED: bring the recipe to the reference "
            "or add a deviation with its reason",
            file=sys.stderr,
        )
    return 1 if unexplained else 0


def cmd_facts(args: argparse.Namespace) -> int:
    from miles.recipes.facts import format_table, rows

    bad = 0
    for name in [args.name] if args.name else names():
        spec = shared(name).model
        print(format_table(name, spec))
        bad += sum(r.bad for r in rows(spec))
    if bad:
        print(f"{bad} config.json value(s) DIFFER from the recipe's flags or map to no flag", file=sys.stderr)
    return 1 if bad else 0


def cmd_record(args: argparse.Namespace) -> int:
    from miles.recipes.status import RUNS_DIR, record_run

    form = shared(args.name).for_platform(args.platform)
    profile = form.profile(args.model, args.platform, args.nodes, args.gpus)
    path = record_run(form, profile, args.run_json, args.dir or RUNS_DIR)
    print(f"wrote {path}: {form.name} {profile.describe()} is verified by {args.run_json}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from miles.parallel import validate
    from miles.recipes.recipe import lane_megatron_core

    cases = []
    for name in [args.name] if args.name else names():
        for form in variants(name):
            for p in form.profiles:
                shape = form.resolve(p.model, env={}).shape
                verdict = validate(p.parallel, p.world_size, shape, lane_megatron_core(p.platform))
                cases.append((f"{name} [{form.variant}] {p.describe()}", p, shape, verdict))
    proofs = [None] * len(cases)
    if args.megatron:
        from miles.megatron.proof import Case, prove

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


def cmd_prepare(args: argparse.Namespace) -> int:
    """The recipe's checkpoint plan for the model, run by the checkpoint command's own runner."""
    import os

    from miles.ckpt.cli import MODEL_DIR_ENV, handled, run_prepare
    from miles.recipes import load

    given = {
        "model_dir": args.model_dir or os.environ.get(MODEL_DIR_ENV),
        "source": args.source,
        "stage_dir": args.stage_dir,
        "data_dir": args.data_dir,
    }
    plan = load(args.name, platform=args.platform).checkpoint_plan(
        args.model, **{k: v for k, v in given.items() if v}
    )
    return handled(
        lambda: run_prepare(plan, args), "prepare", "python -m miles.recipes prepare", Path(plan.model_dir)
    )


def cmd_references(args: argparse.Namespace) -> int:
    from miles.recipes import references
    from miles.recipes.reread import reread
    from miles.recipes.upstream import Mirror, MirrorError

    chosen = [args.name] if args.name else list(names())
    if not (args.check or args.update):
        for name in chosen:
            for ref in references.load(name):
                print(f"{name} {ref.platform} {ref.model}: {ref.script} on {ref.source.hardware}")
                print(f"  {ref.source.command_line()}")
        return 0
    if args.mirror is None:
        print("error: --check and --update need --mirror PATH (a clone of radixark/miles)", file=sys.stderr)
        return 2
    try:
        findings = reread(chosen, Mirror(args.mirror), args.branch)
    except MirrorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.update:
        unreadable = [f for f in findings if f.launch is None]
        for finding in unreadable:
            print("\n".join(finding.lines()), file=sys.stderr)
        if unreadable:
            return 1
        for name in chosen:
            launches = [f.launch for f in findings if f.recipe == name]
            if launches:
                print(f"wrote {references.write_launches(references.path(name), launches)}")
        return 0
    for finding in findings:
        print("\n".join(finding.lines()))
    bad = sum(not f.ok for f in findings)
    if bad:
        print(f"{bad} of {len(findings)} reference reading(s) differ from {args.mirror}", file=sys.stderr)
    cited = _check_citations(Mirror(args.mirror), args.branch) if not args.name else 0
    return 1 if bad or cited else 0


def _check_citations(mirror, branch: str) -> int:
    """The model specs' citations of upstream files and the seed's ROCm image variables, each
    read again from the mirror; the number that fail."""
    from miles.recipes.reread import citation_problems, citations, image_env_problems

    failed = 0
    for citation in citations():
        problems = citation_problems(mirror, citation, branch)
        failed += bool(problems)
        head = f"{citation.spec} {citation.key}: radixark/miles {citation.path}@{citation.commit}"
        print("\n".join(f"FAIL {p}" for p in problems) or f"ok   {head} says {citation.value!r}")
    problems = image_env_problems(mirror, branch)
    failed += bool(problems)
    print(
        "\n".join(f"FAIL {p}" for p in problems)
        or "ok   the seed's ROCm image variables (rocm_image_env.json)"
    )
    if failed:
        print(f"{failed} citation(s) of upstream differ from {mirror.path}", file=sys.stderr)
    return failed


if __name__ == "__main__":
    sys.exit(main())
