"""The reference recipes (radixark/miles) as quoted data: one JSON file per recipe.

Each file lists readings: which launcher script of the seed framework, at which commit of
its main branch, run with which of its own flags on which hardware (`Upstream`), and what
that launcher then passes to its trainer, token for token, with the job's variables. The
quoted values are never typed in: `python -m miles.recipes references --check --mirror PATH`
reads every one again from a local mirror of radixark/miles (miles.recipes.upstream) and
fails on any difference or on a commit that is not on main; `--update` rewrites the quoted
values from the mirror after the configuration (commit, settings) was changed by hand.
Nothing here is code from there.
"""

from __future__ import annotations

import json
import shlex
from functools import cache
from pathlib import Path

from miles.recipes.fidelity import Reference, grouped
from miles.recipes.upstream import Launch, Upstream

DIR = Path(__file__).resolve().parent
FORMAT = 1


class ReferenceFileError(ValueError):
    pass


def path(recipe: str) -> Path:
    return DIR / f"{recipe}.json"


@cache
def rocm_image_env() -> dict:
    """The seed framework's ROCm image variables as quoted (rocm_image_env.json): repo, path,
    commit and env."""
    return json.loads((DIR / "rocm_image_env.json").read_text())


@cache
def load(recipe: str) -> tuple[Reference, ...]:
    """The readings of `recipe` (an empty tuple when it has no reference file)."""
    file = path(recipe)
    return read_file(file) if file.is_file() else ()


def read_file(file: Path) -> tuple[Reference, ...]:
    return tuple(_reading(file, i, r) for i, r in enumerate(_document(file)["readings"]))


def _document(file: Path) -> dict:
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ReferenceFileError(f"{file}: {exc}") from None
    if doc.get("format") != FORMAT or not isinstance(doc.get("readings"), list):
        raise ReferenceFileError(f"{file}: expected format {FORMAT} with a list of readings")
    return doc


def _reading(file: Path, index: int, raw: dict) -> Reference:
    where = f"{file}: reading {index}"
    try:
        up = raw["upstream"]
        source = Upstream(
            script=up["script"], commit=up["commit"], entry=up["entry"],
            settings=tuple(up["settings"].items()), hardware=up["hardware"], nvlink=bool(up["nvlink"]),
            environ=tuple(up.get("environ", {}).items()), repo=up.get("repo", "radixark/miles"),
        )  # fmt: skip
        argv = tuple(token for group in raw["argv"] for token in shlex.split(group))
        env = tuple(sorted((str(k), str(v)) for k, v in raw["env"].items()))
        return Reference(raw["platform"], raw["model"], source, argv, env)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ReferenceFileError(f"{where}: malformed ({type(exc).__name__}: {exc})") from None


def write_launches(file: Path, launches: list[Launch]) -> Path:
    """Rewrite the quoted argv and variables of the file's readings, in order, keeping their
    configuration."""
    doc = _document(file)
    if len(launches) != len(doc["readings"]):
        raise ReferenceFileError(f"{file}: {len(doc['readings'])} readings, {len(launches)} launches")
    for raw, launch in zip(doc["readings"], launches, strict=True):
        raw["argv"] = grouped(launch.argv)
        raw["env"] = dict(launch.env)
    file.write_text(json.dumps(doc, indent=1) + "\n")
    load.cache_clear()
    return file
