"""The ROCm image's source builds checked against what their pinned sources say.

docker/Dockerfile.rocm builds sglang's kernels, aiter, mori and torch-memory-saver from source.
What each needs at its pin was read from its own files and is kept in miles/image/facts/, one
TOML file per (distribution, pin) citing where each fact was read (`name`, `pin`, `source`...).
`source_build_problems` holds the Dockerfile's build steps and the stack's lock to them: the
kernels built from the tree sglang keeps them in, with its ROCm pyproject and the GPU target;
every requirement and build requirement of aiter and mori pinned in the lock (the builds run
without isolation), and nothing installed under the lock that pins otherwise; aiter patched
where the locked torch passes it what the pinned commit refuses; torch-memory-saver built with
what its setup.py reads to choose HIP. A pin without a facts file is a problem too: its needs
are unread. `invoke refresh-image` refuses to build on any (miles.image.plan.pins_problems).
Standard library only.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from pathlib import Path

from miles.image.config import ImageConfig, Variant, load_images, normalize
from miles.image.pins import Lock, dockerfile_args, parse_lock
from miles.image.te_support import in_range

FACTS_DIR = Path(__file__).with_name("facts")
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*([^;]*)")


def load_facts(directory: Path = FACTS_DIR) -> dict[tuple[str, str], dict]:
    """(distribution, pin) -> its facts, for every facts file that names both."""
    out = {}
    for path in sorted(directory.glob("*.toml")):
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
        if "name" in data and "pin" in data:
            out[(normalize(data["name"]), data["pin"])] = {**data, "path": path.name}
    return out


def run_steps(dockerfile: Path) -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined, comments dropped."""
    steps: list[str] = []
    parts: list[str] | None = None
    for line in dockerfile.read_text().splitlines():
        stripped = line.strip()
        if parts is None:
            if not stripped.startswith("RUN "):
                continue
            parts, stripped = [], stripped[4:].strip()
        elif stripped.startswith("#"):
            continue  # a comment inside a continued instruction is no part of it
        continued = stripped.endswith("\\")
        parts.append(stripped.removesuffix("\\").strip())
        if not continued:
            steps.append(" ".join(p for p in parts if p))
            parts = None
    return steps


def requirement(text: str) -> tuple[str, str]:
    """`pandas==3.0.3; python_version >= "3.11"` -> ("pandas", "==3.0.3")."""
    match = _NAME.match(text)
    if match is None:
        raise ValueError(f"not a requirement: {text!r}")
    return normalize(match[1]), match[2].strip()


def source_build_problems(root: Path, variant: Variant, config: ImageConfig | None = None) -> list[str]:
    """What the variant's source builds would hit, by what their pinned sources say."""
    config = config or load_images()
    stack = config.stack(variant.stack)
    if not stack.source_builds:
        return []
    dockerfile = root / variant.dockerfile
    args = dockerfile_args(dockerfile, root=root)
    lock = parse_lock(root / stack.lock_path, root=root)
    steps = run_steps(dockerfile)
    facts = load_facts()
    problems = []
    for build in stack.source_builds:
        pin = args.get(build.pin, (None,))[0]
        found = facts.get((build.dist, pin))
        if found is None:
            problems.append(
                f"{build.dist} @ {pin}: no facts file in miles/image/facts says what it needs to build at this pin; "
                "read its build files there and write one (name, pin, source, ...)"
            )
            continue
        check = _CHECKS.get(build.dist)
        if check is not None:
            where = (
                f"{variant.dockerfile} ({build.dist} @ {str(pin)[:12]}, miles/image/facts/{found['path']})"
            )
            problems += [f"{where}: {p}" for p in check(found, steps, lock, root, variant)]
    return problems


def _step(steps: list[str], marker: str) -> str:
    return next((s for s in steps if marker in s), "")


def _kernels(facts: Mapping, steps: list[str], lock: Lock, root: Path, variant: Variant) -> list[str]:
    step = _step(steps, facts["setup"])
    if not step:
        return [f"no RUN step runs {facts['setup']}"]
    out = []
    if f"cd /opt/sglang/{facts['source_tree']}" not in step:
        out.append(
            f"the kernels are built from sglang's {facts['source_tree']} (its own tree at this release); the step does not cd there"
        )
    if facts["rocm_pyproject"] not in step:
        out.append(f"the step does not put {facts['rocm_pyproject']} in place of the tree's pyproject.toml")
    if f"{facts['target_variable']}=" not in step:
        out.append(f"the step does not set {facts['target_variable']} (else the kernels target gfx942)")
    return out


def _requirements(facts: Mapping, steps: list[str], lock: Lock, root: Path, variant: Variant) -> list[str]:
    out = []
    for key in ("requirements", "build_requires"):
        for text in facts.get(key, ()):
            name, spec = requirement(text)
            pin = lock.pins.get(name)
            if pin is None:
                out.append(
                    f"{key} {text}: the lock does not pin {name}, and the build runs without isolation"
                )
            elif key == "build_requires" and spec and not in_range(pin.version, spec):
                out.append(f"build requirement {text}: the lock pins {name}=={pin.version}")
    marker = facts["source"].split("@")[0].split(":")[0]  # ROCm/aiter
    step = _step(steps, marker)
    if "-r requirements.txt" in step and "-c" in step:
        clashes = [
            f"{name}{spec} (lock {lock.pins[name].version})"
            for name, spec in map(requirement, facts.get("requirements", ()))
            if spec.startswith("==") and name in lock.pins and lock.pins[name].version != spec[2:]
        ]
        if clashes:
            out.append(
                f"it installs {marker}'s requirements.txt under the lock, which pins otherwise: {', '.join(clashes)} "
                "(pip stops with ResolutionImpossible)"
            )
    stream = facts.get("torch_stream")
    torch = lock.pins.get("torch")
    if stream and torch and in_range(torch.version, f">={stream['from_torch']}"):
        patches = sorted((root / "docker/patches/rocm-aiter").glob("*.patch"))
        patched = any(stream["file"] in p.read_text() for p in patches)
        if not patched or "patches/rocm-aiter" not in step:
            out.append(
                f"the lock's torch {torch.version} passes {stream['file']} a plain torch.Stream it refuses: apply a "
                "patch of docker/patches/rocm-aiter that accepts it"
            )
    return out


def _memory_saver(facts: Mapping, steps: list[str], lock: Lock, root: Path, variant: Variant) -> list[str]:
    step = _step(steps, "torch_memory_saver")
    out = [
        f"the step sets {name}, which its setup.py never reads"
        for name in facts.get("reads_no", ())
        if f"{name}=" in step
    ]
    if "hipcc" in facts["selects_hip_by"] and not ("/opt/rocm/bin" in step and "command -v hipcc" in step):
        out.append(
            "its setup.py builds for HIP only with hipcc on PATH: the step must put /opt/rocm/bin on PATH and "
            "stop when `command -v hipcc` finds none (else it builds the CUDA form)"
        )
    return out


_CHECKS = {
    "sglang-kernel": _kernels,
    "amd-aiter": _requirements,
    "amd-mori": _requirements,
    "torch-memory-saver": _memory_saver,
}
