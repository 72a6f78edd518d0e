"""`invoke lock`: regenerate requirements/<stack>.txt from requirements/<stack>.in with uv.

Each stack resolves for its own Python and wheel platform (`uv pip compile --python-version
--python-platform`), so the GPU stacks are resolved here from package metadata alone,
without downloading torch. Versions already in the lock are kept unless `upgrade` asks for
new ones, and every package in the lock stays in it, including pins others appended by hand.
Stacks whose torch build lives outside PyPI (ROCm) resolve on PyPI, where the same public
versions exist, and are then renamed to their build (`torch==X+rocm7.2`); CUDA-only packages
they exclude are left to the image's source builds. The cpu stack excludes the CUDA libraries
PyPI's Linux torch wheel depends on (the CPU build needs none), so a lock resolved where only
PyPI's torch is on offer stays the same. Every other stack pins public versions only, so PyPI
serves each pin: a local build the resolver took from a wheel folder or a
torch index (`2.13.0+cpu`) is written as its public version (`2.13.0`), which that build
still satisfies. The lock is replaced atomically.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from miles.image.config import Stack, normalize, stack_python
from miles.image.install import find_links_arguments
from miles.image.pins import parse_lock

Run = Callable[[Sequence[str]], subprocess.CompletedProcess]
PYPI_INDEX = "https://pypi.org/simple"
_LINE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>\S+)$")


class LockFailed(RuntimeError):
    """uv could not resolve the stack; the message carries uv's explanation."""


@dataclass(frozen=True)
class LockResult:
    stack: str
    path: str
    pins: tuple[tuple[str, str], ...]  # (name, version) as written
    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]  # "name old -> new"
    excluded: tuple[str, ...]
    excluded_why: str = "left to the image's source builds"

    def render(self) -> str:
        out = [f"{self.path}: {len(self.pins)} pins"]
        for title, items in (("added", self.added), ("removed", self.removed), ("changed", self.changed)):
            if items:
                out.append(f"  {title}: {', '.join(items)}")
        if self.excluded:
            out.append(f"  {self.excluded_why}: {', '.join(self.excluded)}")
        if not (self.added or self.removed or self.changed):
            out.append("  unchanged")
        return "\n".join(out)


def uv_executable() -> list[str]:
    found = shutil.which("uv")
    if found:
        return [found]
    if importlib.util.find_spec("uv") is None:
        raise LockFailed(
            "uv is not installed: `invoke lock` resolves with it; pip install uv (the cpu stack pins it)"
        )
    return [sys.executable, "-m", "uv"]


def compile_command(
    stack: Stack,
    inputs: Sequence[Path],
    output: Path,
    *,
    upgrade: bool,
    excludes: Path | None,
    extra: Sequence[str],
) -> list[str]:
    command = [*uv_executable(), "pip", "compile", *map(str, inputs)]
    command += ["--python-version", stack_python(stack), "--python-platform", stack.platform]
    command += ["--no-header", "--no-annotate", "--quiet", "--output-file", str(output)]
    if upgrade:
        command.append("--upgrade")
    if excludes is not None:
        command += ["--excludes", str(excludes)]
    return command + list(extra)


def _run(command: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), capture_output=True, text=True)


def _read_pins(path: Path) -> list[tuple[str, str]]:
    pins = []
    for line in path.read_text().splitlines():
        match = _LINE.match(line.strip())
        if match:
            pins.append((match["name"], match["version"]))
    return pins


def lock_stack(
    root: Path,
    stack: Stack,
    *,
    upgrade: bool = False,
    extra: Sequence[str] | None = None,
    lanes: Sequence[str] = (),
    run: Run = _run,
) -> LockResult:
    """Resolve `stack` and rewrite its lock; raises LockFailed and leaves the lock untouched."""
    extra = find_links_arguments(os.environ) if extra is None else list(extra)
    source = root / stack.input_path
    target = root / stack.lock_path
    if not source.is_file():
        raise LockFailed(f"{stack.input_path} does not exist; it lists the stack's top-level requirements")
    before = dict(parse_lock(target).pins) if target.is_file() else {}
    produced = {normalize(new) for _old, new in stack.rename} | set(stack.retag)
    with tempfile.TemporaryDirectory(prefix="miles-lock-") as tmp:
        tmpdir = Path(tmp)
        # Pins already in the lock stay: they are inputs (versions preferred from the old lock).
        kept = tmpdir / "kept.in"
        kept.write_text(
            "".join(f"{name}\n" for name in before if name not in produced and not stack.excluded(name))
        )
        output = tmpdir / "lock.txt"
        if target.is_file():
            output.write_text("".join(f"{n}=={p.version}\n" for n, p in before.items() if n not in produced))
        inputs = [source, kept]
        _compile(run, compile_command(stack, inputs, output, upgrade=upgrade, excludes=None, extra=extra))
        excluded = sorted({normalize(n) for n, _v in _read_pins(output) if stack.excluded(n)})
        if excluded:
            excludes = tmpdir / "excludes.txt"
            excludes.write_text("".join(f"{n}\n" for n in excluded))
            _compile(
                run, compile_command(stack, inputs, output, upgrade=upgrade, excludes=excludes, extra=extra)
            )
        pins = _for_build(stack, _read_pins(output))
        text = render_lock(stack, pins, lanes=lanes, excluded=excluded)
        staged = target.with_name(f".{target.name}.tmp")
        staged.write_text(text)
        os.replace(staged, target)
    after = {normalize(n): v for n, v in pins}
    return LockResult(
        stack=stack.name,
        path=stack.lock_path,
        pins=tuple(pins),
        added=tuple(sorted(set(after) - set(before))),
        removed=tuple(sorted(set(before) - set(after))),
        changed=tuple(
            f"{n} {before[n].version} -> {after[n]}"
            for n in sorted(set(before) & set(after))
            if before[n].version != after[n]
        ),
        excluded=tuple(excluded),
        excluded_why=excluded_why(stack),
    )


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def excluded_why(stack: Stack) -> str:
    """Why the stack's lock leaves its excluded packages out."""
    if stack.backend == "cpu":
        return "left out, the CPU build of torch needs none of them"
    return "left to the image's source builds"


def _compile(run: Run, command: list[str]) -> None:
    done = run(command)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout or "").strip().splitlines()[-15:])
        raise LockFailed(f"uv could not resolve the stack (exit {done.returncode}):\n{tail}")


def _for_build(stack: Stack, pins: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Rename and retag the torch family for builds published outside PyPI; without such a
    build, drop local version tags so that every pin is one PyPI serves."""
    renames = dict(stack.rename)
    out = []
    for name, version in pins:
        key = normalize(name)
        if not stack.torch_build:
            version = version.split("+", 1)[0]
        elif key in stack.retag and "+" not in version:
            version = f"{version}+{stack.torch_build}"
        out.append((renames.get(key, name), version))
    return sorted(out, key=lambda pin: normalize(pin[0]))


def render_lock(
    stack: Stack, pins: Sequence[tuple[str, str]], *, lanes: Sequence[str] = (), excluded: Sequence[str] = ()
) -> str:
    head = [f"# Pinned stack '{stack.name}': Python {stack_python(stack)}, {stack.platform}."]
    if lanes:
        head.append(f"# Lanes: {', '.join(lanes)}.")
    head += [
        f"# Generated by `invoke lock --stack {stack.name}` from {stack.input_path}. Appending a",
        "# name==version line by hand is fine: the next lock keeps it.",
        *_torch_source_lines(stack),
    ]
    if excluded:
        listed = textwrap.wrap(
            f"{_sentence(excluded_why(stack))}: {', '.join(excluded)}.", 88, break_on_hyphens=False
        )
        head += [f"# {line}" for line in listed]
    return "\n".join(head + [f"{name}=={version}" for name, version in pins]) + "\n"


def _torch_source_lines(stack: Stack) -> list[str]:
    """Where the lock's torch comes from, as header lines."""
    if stack.torch_build:
        retagged = ", ".join(stack.retag + tuple(new for _old, new in stack.rename))
        return [
            f"# {retagged}: {stack.torch_build} builds from",
            f"# {stack.torch_index};",
            "# installers get that index from PIP_EXTRA_INDEX_URL or PIP_FIND_LINKS, never from here.",
        ]
    if stack.torch_index == PYPI_INDEX:
        return [
            f"# torch is the build published at {stack.torch_index};",
            "# installers get that index from PIP_EXTRA_INDEX_URL or PIP_FIND_LINKS, never from here.",
        ]
    return [
        f"# Public versions only: PyPI serves every pin. {stack.torch_index}",
        f"# publishes {stack.backend} torch builds of the same versions, which installers prefer",
        "# when they see that index (PIP_EXTRA_INDEX_URL) or a folder holding one (PIP_FIND_LINKS).",
    ]
