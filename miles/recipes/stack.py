"""What the pinned stack accepts: every flag a recipe renders, checked when the command is built.

A `--sglang-<name>` flag that miles.train does not define itself goes to SGLang's ServerArgs
as field `<name>` (miles.train.sglang_engine.server_kwargs), so it must be a field of the
sglang the platform's lane pins (requirements/<stack>.txt). The field names of each pinned
release are kept in `stacks/sglang-<version>-serverargs.txt`, written from the installed package's
own class (`python tests/unit/sglang_probe.py --fields`), and tests/unit/test_recipe_stack.py
checks the list against the installed sglang's ServerArgs. Every other flag must be one
`python -m miles.train` parses (the sections' flags, miles.train.config.FLAGS), and a Megatron
command's flags must be ones the Megatron backend can act on with the platform's stack: its
declaration of each (miles.megatron.options) names what a flag needs (Transformer Engine's
spec, a GPU, another flag) or why it is refused. None of these imports is heavy: the field list
is a text file, the trainer's sections are standard-library dataclasses, the declaration a table.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from miles.recipes.fidelity import duplicates, pairs, twice

FIELDS_DIR = Path(__file__).with_name("stacks")
SGLANG_PREFIX = "--sglang-"


class StackError(ValueError):
    pass


@cache
def lane_sglang(platform: str) -> tuple[str, str] | None:
    """(sglang version, lock file) of the lane of `platform`; None where the lane pins no
    sglang (cpu) or the locks are not in this checkout."""
    from miles.image.config import load_images
    from miles.image.pins import parse_lock

    root = Path(__file__).resolve().parents[2]
    try:
        stack = load_images().stack_of_backend(platform)
        pin = parse_lock(root / stack.lock_path).pins.get("sglang")
    except (OSError, ValueError, KeyError):
        return None
    return (pin.version, stack.lock_path) if pin else None


def fields_file(version: str) -> Path:
    return FIELDS_DIR / f"sglang-{version}-serverargs.txt"


@cache
def sglang_fields(version: str) -> frozenset[str]:
    """The ServerArgs field names of sglang `version`, from its stored list."""
    path = fields_file(version)
    try:
        text = path.read_text()
    except OSError:
        raise StackError(
            f"no ServerArgs field list for the pinned sglang {version} ({path}); with that sglang installed, "
            f"write it: python tests/unit/sglang_probe.py --fields > {path}"
        ) from None
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


@cache
def trainer_flags() -> frozenset[str]:
    from miles.train.config import FLAGS

    return frozenset(f.option for f in FLAGS)


def stack_problems(argv: Sequence[str], platform: str) -> list[tuple[str, str]]:
    """(flag, problem) for every flag of `argv` the stack pinned for `platform` lacks."""
    known = trainer_flags()
    sglang = lane_sglang(platform) if platform != "cpu" else None
    out = []
    for token in argv:
        if not token.startswith("--"):
            continue
        flag = token.partition("=")[0]
        if flag in known:
            continue
        if flag.startswith(SGLANG_PREFIX) and sglang is not None:
            version, lock = sglang
            name = flag[len(SGLANG_PREFIX) :].replace("-", "_")
            fields = sglang_fields(version)
            if name not in fields:
                close = difflib.get_close_matches(name, sorted(fields), n=3, cutoff=0.6)
                hint = f" (close: {', '.join(close)})" if close else ""
                out.append((flag, f"sglang {version} ({lock}) has no ServerArgs field '{name}'{hint}"))
            continue
        if flag.startswith(SGLANG_PREFIX):
            out.append((flag, f"the {platform} lane pins no sglang, so no engine takes it"))
            continue
        close = difflib.get_close_matches(flag, sorted(known), n=3, cutoff=0.7)
        hint = f" (close: {', '.join(close)})" if close else ""
        out.append((flag, f"python -m miles.train has no flag {flag}{hint}"))
    return out


@cache
def stack_has_te(platform: str) -> bool:
    """Whether the stack pinned for `platform` carries Transformer Engine (miles.image.te)."""
    if platform == "cpu":
        return False
    from miles.image.config import load_images
    from miles.image.te import stack_carries_te

    try:
        return stack_carries_te(load_images().stack_of_backend(platform).name)
    except (OSError, ValueError, KeyError):
        return False


def backend_problems(argv: Sequence[str], platform: str, backend: str) -> list[tuple[str, str]]:
    """Flags the chosen training backend refuses, or cannot act on with the platform's stack,
    each with the reason: the Megatron backend's declaration of what each flag needs
    (miles.megatron.options). A flag no component of the run consumes is named by the run's
    start-up note (miles.train.consumption)."""
    if backend != "megatron":
        return []
    from miles.megatron.options import render_problems

    return render_problems(argv, platform, stack_has_te(platform))


def command_problems(argv: Sequence[str], platform: str, backend: str | None = None) -> list[tuple[str, str]]:
    """Stack problems, flags given more than once with different values, and (with `backend`) the
    flags that backend refuses or cannot act on here."""
    repeated = [(flag, twice(values)) for flag, values in duplicates(pairs(argv))]
    return [*repeated, *stack_problems(argv, platform), *backend_problems(argv, platform, backend or "")]
