"""Re-read every reference recipe from a local mirror of the seed framework and say what differs.

    python -m miles.recipes references --check --mirror /path/to/radixark-miles [--branch main]

For each reading in miles/recipes/references/: its commit must exist in the mirror and be on
`branch`, and the launcher, read at that commit (miles.recipes.upstream), must pass exactly
the quoted argv and set exactly the quoted variables. Any other outcome is a finding.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

from miles.recipes import references
from miles.recipes.fidelity import Reference, grouped
from miles.recipes.pysource import SourceError
from miles.recipes.upstream import Launch, Mirror, MirrorError, read_launch


@dataclass(frozen=True)
class Finding:
    recipe: str
    reference: Reference
    launch: Launch | None  # what the mirror says (None when it could not be read)
    problems: tuple[str, ...]  # empty: the quote is exact

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        ref = self.reference
        head = f"{'ok  ' if self.ok else 'FAIL'} {self.recipe} {ref.platform} {ref.model}: {ref.script} ({ref.source.hardware})"
        if self.ok:
            return [f"{head}: {len(ref.argv)} tokens, {len(ref.env)} variables"]
        return [head, *(f"  {p}" for p in self.problems)]


def reread_one(mirror: Mirror, recipe: str, reference: Reference, branch: str) -> Finding:
    source = reference.source
    full = mirror.commit(source.commit)
    if full is None:
        return Finding(recipe, reference, None, (f"commit {source.commit} is not in {mirror.path}",))
    problems = []
    if full != source.commit:
        problems.append(f"cite the full commit {full}, not {source.commit}")
    if not mirror.on_branch(full, branch):
        problems.append(
            f"commit {full[:12]} is not on {branch} (an unmerged branch's commit is no reference)"
        )
    try:
        launch = read_launch(mirror, source)
    except (SourceError, MirrorError) as exc:
        return Finding(recipe, reference, None, (*problems, f"cannot read the launcher: {exc}"))
    problems += _argv_problems(reference, launch)
    problems += _env_problems(reference, launch)
    return Finding(recipe, reference, launch, tuple(problems))


def _argv_problems(reference: Reference, launch: Launch) -> list[str]:
    if tuple(launch.argv) == tuple(reference.argv):
        return []
    diff = difflib.unified_diff(
        grouped(reference.argv), grouped(launch.argv), "quoted", "upstream", lineterm="", n=0
    )
    return [
        "argv differs from what the launcher passes:",
        *(f"  {line}" for line in diff if not line.startswith("@@")),
    ]


def _env_problems(reference: Reference, launch: Launch) -> list[str]:
    quoted, actual = dict(reference.env), dict(launch.env)
    out = []
    for name in sorted(set(quoted) | set(actual)):
        if quoted.get(name) != actual.get(name):
            out.append(f"variable {name}: quoted {quoted.get(name)!r}, upstream {actual.get(name)!r}")
    return out


def reread(names: Iterable[str], mirror: Mirror, branch: str = "main") -> list[Finding]:
    """A finding for every reading of every recipe in `names`."""
    return [reread_one(mirror, name, ref, branch) for name in names for ref in references.load(name)]
