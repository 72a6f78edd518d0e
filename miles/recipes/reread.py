"""Re-read every reference recipe from a local mirror of the seed framework and say what differs.

    python -m miles.recipes references --check --mirror /path/to/radixark-miles [--branch main]

For each reading in miles/recipes/references/: its commit must exist in the mirror and be on
`branch`, and the launcher, read at that commit (miles.recipes.upstream), must pass exactly
the quoted argv and set exactly the quoted variables. Any other outcome is a finding.
"""

from __future__ import annotations

import difflib
import re
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


# --- the citations of the model specs and the seed's ROCm image variables --------------------------

_CITATION = re.compile(r"radixark/miles (?P<path>\S+)@(?P<commit>[0-9a-f]{7,40})")


@dataclass(frozen=True)
class Citation:
    """A published value of a model spec (a recipe module's ModelSpec) read from a file of upstream."""

    spec: str  # the model
    key: str
    value: object
    path: str
    commit: str  # as cited (an abbreviation)


def citations() -> list[Citation]:
    """Every `radixark/miles <path>@<commit>` citation of a published value in the model specs."""
    import importlib

    from miles.recipes import names
    from miles.recipes.models import ModelSpec

    modules = [importlib.import_module(f"miles.recipes.library.{name}") for name in names()]
    specs = {id(v): v for m in modules for v in vars(m).values() if isinstance(v, ModelSpec)}
    out = []
    for spec in specs.values():
        published = spec.published
        for key, text in published.sources if published else ():
            for match in _CITATION.finditer(text):
                out.append(Citation(spec.name, key, published.value(key), match["path"], match["commit"]))
    return out


def citation_problems(mirror: Mirror, citation: Citation, branch: str = "main") -> list[str]:
    """Why the cited commit does not show the value: it is not in the mirror, not on `branch`,
    the file is not there at that commit, or the value is not in it."""
    where = f"{citation.spec} {citation.key}: radixark/miles {citation.path}@{citation.commit}"
    full = mirror.commit(citation.commit)
    if full is None:
        return [f"{where}: commit {citation.commit} is not in {mirror.path}"]
    if not mirror.on_branch(full, branch):
        return [f"{where}: commit {full[:12]} is not on {branch} (an unmerged branch's commit is no source)"]
    text = mirror.show(full, citation.path)
    if text is None:
        return [f"{where}: {citation.path} does not exist at {full[:12]}"]
    if str(citation.value) not in text:
        return [f"{where}: {citation.path} at {full[:12]} does not say {citation.value!r}"]
    return []


def image_env_problems(mirror: Mirror, branch: str = "main") -> list[str]:
    """The seed's ROCm image variables as quoted (references/rocm_image_env.json) against its
    Dockerfile at the cited commit: every ENV it sets, with its value."""
    quoted = references.rocm_image_env()
    where = f"radixark/miles {quoted['path']}@{quoted['commit'][:12]}"
    full = mirror.commit(quoted["commit"])
    if full is None or not mirror.on_branch(full, branch):
        return [f"{where}: the commit is not on {branch} in {mirror.path}"]
    text = mirror.show(full, quoted["path"])
    if text is None:
        return [f"{where}: no such file"]
    found = dict(_ENV_LINE.findall(text))
    runtime = {k: v for k, v in found.items() if k in quoted["env"] or k not in _BUILD_ENV}
    if runtime != quoted["env"]:
        diff = sorted(set(runtime.items()) ^ set(quoted["env"].items()))
        return [f"{where}: the quoted variables differ from the file's ENV lines: {diff}"]
    return []


_ENV_LINE = re.compile(r"^ENV\s+([A-Z][A-Z0-9_]*)=(\S+)\s*$", re.MULTILINE)
# the ENV lines of the seed's image that steer its build (compilers, targets), not a job
_BUILD_ENV = frozenset({
    "MAX_JOBS", "GPU_ARCH", "PYTORCH_ROCM_ARCH", "GPU_ARCH_LIST", "AMDGPU_TARGET", "NVTE_FRAMEWORK",
    "NVTE_ROCM_ARCH", "NVTE_USE_HIPBLASLT", "NVTE_USE_ROCM", "CMAKE_PREFIX_PATH",
})  # fmt: skip
