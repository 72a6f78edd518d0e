"""Transformer Engine on the GPU stacks: one statement per stack, and what must agree with it.

`images.toml`'s `[transformer_engine.<stack>]` table says where each GPU stack gets TE. CUDA
(`source = "lock"`): the lock pins the meta package and the CUDA 13 core library at one
version, and the Dockerfile builds the torch extension (published as an sdist only) at that
version, named by its `version_arg`. ROCm: AMD's build from `source` at the release tag
`ref`, which the Dockerfile's `ref_arg` and `version_arg` must state. `te_problems` lists
every disagreement (`invoke refresh-image` refuses to build on one; `--dry` prints them),
`te_summary` is the line `refresh-image --dry` shows, and the lane's preflight imports TE
against `expected_version` (miles.ci.machine.te_preflight). A stack's TE must also be one the
pinned megatron-core supports (`support_problems`, miles.image.te_support). Standard library
only.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from miles.image.config import IMAGES_PATH, ImageConfig, Variant, load_images, normalize
from miles.image.pins import parse_lock

_ARG = re.compile(r"^\s*ARG\s+(?P<name>[A-Za-z0-9_]+)\s*=\s*(?P<value>\S+)\s*$")


@dataclass(frozen=True)
class TESource:
    stack: str
    source: str  # "lock", or the repository AMD's build comes from
    version_arg: str
    packages: tuple[str, ...] = ()  # lock: the pinned distributions, all at one version
    extension: str = ""  # lock: the torch extension the image builds
    version: str = ""  # not from the lock: the version stated here
    ref: str = ""  # not from the lock: the release tag built
    ref_arg: str = ""


def te_sources(path: Path = IMAGES_PATH) -> dict[str, TESource]:
    """Stack name -> where it gets Transformer Engine (stacks without TE are absent)."""
    with open(path, "rb") as fh:
        table = tomllib.load(fh).get("transformer_engine", {})
    return {
        stack: TESource(
            stack=stack,
            source=entry["source"],
            version_arg=entry["version_arg"],
            packages=tuple(normalize(p) for p in entry.get("packages", ())),
            extension=normalize(entry.get("extension", "")),
            version=entry.get("version", ""),
            ref=entry.get("ref", ""),
            ref_arg=entry.get("ref_arg", ""),
        )
        for stack, entry in table.items()
    }


def stack_carries_te(stack: str) -> bool:
    return stack in te_sources()


def expected_version(root: Path, stack: str) -> tuple[str, str] | None:
    """(version, where it is stated) of the stack's Transformer Engine; None without TE."""
    source = te_sources().get(stack)
    if source is None:
        return None
    if source.source != "lock":
        return source.version, f"miles/image/images.toml [transformer_engine.{stack}]"
    config = load_images()
    lock = parse_lock(root / config.stack(stack).lock_path, root=root)
    pin = lock.pins.get(source.packages[0])
    return (pin.version, lock.where(pin.name)) if pin else None


def _dockerfile_args(path: Path) -> dict[str, tuple[str, int]]:
    found = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = _ARG.match(line)
        if match:
            found[match["name"]] = (match["value"], number)
    return found


def te_problems(root: Path, variant: Variant, config: ImageConfig | None = None) -> list[str]:
    """Where the variant's lock, Dockerfile and images.toml disagree about Transformer Engine."""
    config = config or load_images()
    source = te_sources().get(variant.stack)
    if source is None:
        return []
    dockerfile = root / variant.dockerfile
    args = _dockerfile_args(dockerfile)
    problems = []
    if source.source == "lock":
        lock = parse_lock(root / config.stack(variant.stack).lock_path, root=root)
        pins = {name: lock.pins.get(name) for name in source.packages}
        missing = [name for name, pin in pins.items() if pin is None]
        if missing:
            return [
                f"transformer-engine: {lock.path} does not pin {', '.join(missing)}; add "
                f"transformer-engine[core-cu13]==<version> to {config.stack(variant.stack).input_path} and "
                "run `invoke lock`"
            ]
        versions = {pin.version for pin in pins.values() if pin is not None}
        if len(versions) > 1:
            shown = ", ".join(f"{p.name}=={p.version} ({lock.where(p.name)})" for p in pins.values() if p)
            problems.append(f"transformer-engine: the lock pins its packages at different versions: {shown}")
        wanted, where = next(iter(pins.values())).version, lock.where(source.packages[0])
    else:
        wanted, where = source.version, f"miles/image/images.toml [transformer_engine.{variant.stack}]"
        stated = args.get(source.ref_arg)
        if stated is None:
            problems.append(
                f"transformer-engine: {variant.dockerfile} has no `ARG {source.ref_arg}=<release tag>`"
            )
        elif stated[0] != source.ref:
            problems.append(
                f"transformer-engine: {variant.dockerfile}:{stated[1]} builds {source.source} at {stated[0]}, "
                f"{where} says {source.ref}"
            )
    stated = args.get(source.version_arg)
    if stated is None:
        problems.append(
            f"transformer-engine: {variant.dockerfile} has no `ARG {source.version_arg}={wanted}` ({where})"
        )
    elif stated[0] != wanted:
        problems.append(
            f"transformer-engine: {variant.dockerfile}:{stated[1]} says {stated[0]}, {where} pins {wanted}"
        )
    if source.extension and f"{source.extension}==${{{source.version_arg}}}" not in dockerfile.read_text():
        problems.append(
            f"transformer-engine: {variant.dockerfile} does not build {source.extension}==${{{source.version_arg}}} "
            "(the torch extension, an sdist, at the lock's version)"
        )
    return problems + support_problems(wanted, where, with_facts=source.source == "lock")


def support_problems(version: str, where: str, *, with_facts: bool) -> list[str]:
    """Where megatron-core does not support the stack's TE: outside its tested range (its
    Requires-Dist), or (`with_facts`: a release whose source miles has read, miles/image/facts)
    a name it imports missing in that release. Empty where megatron-core is not installed."""
    from miles.image import te_support

    specifier = te_support.tested_range()
    if specifier is None:
        return []
    out = [p for p in (te_support.range_problem(version, where, specifier),) if p]
    if with_facts:
        imports = te_support.te_imports(te_support.installed_megatron_core())
        try:
            out += [f"transformer-engine: {u}" for u in te_support.unsupported(version, imports)]
        except FileNotFoundError:
            out.append(
                f"transformer-engine {version}: no facts file says which of megatron-core's TE imports it has; run "
                f"`python -m miles.image.te_support --wheel transformer_engine-{version}-py3-none-any.whl`"
            )
    return out


def te_summary(root: Path, variant: Variant, config: ImageConfig | None = None) -> str:
    """One line: the Transformer Engine the variant's image carries, and where each part comes from."""
    config = config or load_images()
    source = te_sources().get(variant.stack)
    if source is None:
        return "none (the stack carries no Transformer Engine)"
    found = expected_version(root, variant.stack)
    version, where = found if found else ("(not pinned)", "")
    if source.source == "lock":
        lock = parse_lock(root / config.stack(variant.stack).lock_path, root=root)
        torch_pin = lock.pins.get("torch")
        against = f" against torch {torch_pin.version}" if torch_pin else ""
        return (
            f"transformer-engine {version} ({where}; {', '.join(source.packages[1:])} from the lock), "
            f"{source.extension} built in the image{against}"
        )
    archs = dict(variant.build_args).get("GPU_ARCHS", "")
    return (
        f"transformer-engine {version} from {source.source} @ {source.ref}"
        + (f", built for GPU_ARCHS={archs}" if archs else "")
        + f" ({where})"
    )
