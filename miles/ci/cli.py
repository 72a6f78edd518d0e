"""`python -m miles.ci <command>`: every command of the CI, registered in one table.

Exit codes: 0 fine, 1 the command found problems (or a package it needs is missing), 2 bad
usage (unknown suite, lane, label), 3 the machine cannot run a lane (preflight); 141 when the
reader closed the output early (`list --json | head`), quietly. The command modules import
only the standard library and the catalog; each handler imports the rest of what it uses
when it runs, so building the parser (and `list`) never loads a heavy package.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from miles.ci.commands import history, machine, registry, run
from miles.ci.commands.usage import UsageError, check_root
from miles.ci.registry.catalog import CatalogError, UnknownName
from miles.exits import OneLineParser


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add: Callable[[argparse.ArgumentParser], None]  # adds the command's arguments and its handler


COMMANDS: tuple[Command, ...] = (
    Command("list", "list registrations (what runs where)", registry.add_list),
    Command("audit", "maintainer report: disabled tests, coverage gaps, unused suites", registry.add_audit),
    Command("manifest", "suites and their tests, for jobs outside this repository", registry.add_manifest),
    Command(
        "recipes", "which cpu-lane tests train each recipe, and every profile's suite", registry.add_recipes
    ),
    Command("run", "run a lane's (or a suite's) tests: shard, timeouts, retries, reports", run.add_run),
    Command("plan", "print what `run` would do (same options), without running", run.add_plan),
    Command("matrix", "JSON shard matrix of a lane for GitHub's fromJSON", run.add_matrix),
    Command("policy", "cadence and CI labels of a GitHub event (writes $GITHUB_OUTPUT)", run.add_policy),
    Command("affected", "suites a change may skip (from `git diff --name-status -z`)", run.add_affected),
    Command("calibrate", "propose est_time values from measured durations", run.add_calibrate),
    Command("history", "metric history: show runs, untrust runs, plot a metric", history.add_history),
    Command("gate", "gate a metric record directory by hand against the history", history.add_gate),
    Command(
        "preflight", "check a lane's machine before any test runs (exit 3 on problems)", machine.add_preflight
    ),
)


def main(argv: list[str] | None = None) -> int:
    from miles.exits import EXIT_FAILED, missing_package, quiet_broken_pipe

    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if getattr(args, "root", None) is not None:
            check_root(args.root, needs_tests=getattr(args, "needs_tests", False))
        return args.handler(args)
    except (UsageError, UnknownName) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except CatalogError as exc:  # the catalog is input too: a broken one is bad input
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`list --json | head`): stop quietly
        return quiet_broken_pipe()
    except KeyboardInterrupt:  # `run` handles its own signals; every other command just stops
        print(f"interrupted: {args.command} stopped", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:  # a command's optional package (matplotlib, psycopg)
        line = missing_package(exc, f"python -m miles.ci {' '.join((argv or sys.argv[1:])[:1])}")
        if line is None:
            raise
        print(line, file=sys.stderr)
        return EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m miles.ci", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add(sub.add_parser(command.name, help=command.help))
    return parser
