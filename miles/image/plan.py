"""`invoke refresh-image` and `invoke check-image`: plan, skip or build, and verify an image.

The plan is data (tag, hash, the exact docker commands) so `--dry` prints what a real run
would do. A real run checks the Dockerfile's pins against the lock, looks for an image
already labelled with this input hash, and builds only when there is none. The build
context is a staging folder holding exactly the hashed inputs, so nothing outside them can
leak into the image.
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from miles.image.config import ImageConfig, Variant, load_images, normalize, stack_python
from miles.image.inputs import (
    LABEL_HASH,
    LABEL_TAG,
    LABEL_VARIANT,
    InputHash,
    alias_tag,
    check_reference,
    image_tag,
    input_hash,
    parse_tag,
)
from miles.image.pins import (
    Lock,
    Mismatch,
    check_dockerfile,
    diff_installed,
    dockerfile_args,
    extra_installed,
    parse_lock,
)

CONTEXT_DIR = ".miles/image-context"

# Runs a command and returns (exit code, stdout); tests substitute nothing here: they put a
# stand-in `docker` on PATH, because no docker engine exists on the development machines.
Runner = Callable[[Sequence[str]], tuple[int, str]]


class ImageError(RuntimeError):
    """The image cannot be built or verified; the message says why and what to do."""


@dataclass(frozen=True)
class RefreshPlan:
    variant: Variant
    tag: str
    alias: str
    inputs: InputHash
    context: str  # staging folder, relative to the root
    lookups: tuple[str, ...]  # references whose labels may show the image already exists
    build: tuple[str, ...]  # the docker buildx command
    push: bool
    source_builds: tuple[str, ...] = ()  # what the image builds from source, one line each

    def render(self) -> str:
        lines = [
            f"variant     {self.variant.name} ({self.variant.description})",
            f"tag         {self.tag}",
            f"alias       {self.alias} ({'moved to the tag' if self.push else 'local only, not pushed'})",
            f"inputs      sha256 {self.inputs.digest}",
        ]
        lines += [f"  {digest[:12]}  {path}" for path, digest in self.inputs.entries]
        lines.append(f"context     {self.context} (exactly the inputs above)")
        lines += [f"builds      {line}" for line in self.source_builds]
        lines += [f"skip if     {LABEL_HASH}={self.inputs.short}… on {ref}" for ref in self.lookups]
        lines.append("build       " + shlex.join(self.build))
        return "\n".join(lines)


def plan_refresh(
    root: Path,
    variant_name: str,
    *,
    push: bool = False,
    image: str | None = None,
    today: dt.date | None = None,
    config: ImageConfig | None = None,
    move_alias: bool = True,
) -> RefreshPlan:
    config = config or load_images()
    variant = config.variant(variant_name)
    inputs = input_hash(root, variant, config)
    image = image or config.image
    today = today or dt.datetime.now(dt.UTC).date()
    tag = image_tag(image, variant.name, today, inputs.digest)
    alias = alias_tag(image, variant.name)
    context = f"{CONTEXT_DIR}/{variant.name}"
    command = [
        "docker", "buildx", "build",
        "--file", f"{context}/{variant.dockerfile}",
        "--platform", variant.platform,
    ]  # fmt: skip
    stack = config.stack(variant.stack)
    # The stack's facts go in as build args, so the Dockerfile never restates them.
    for key, value in (
        ("STACK", stack.name),
        ("PYTHON_VERSION", stack_python(stack)),
        ("TORCH_INDEX", stack.torch_index),
    ):
        command += ["--build-arg", f"{key}={value}"]
    for key, value in variant.build_args:
        command += ["--build-arg", f"{key}={value}"]
    for key, value in ((LABEL_HASH, inputs.digest), (LABEL_VARIANT, variant.name), (LABEL_TAG, tag)):
        command += ["--label", f"{key}={value}"]
    command += ["--tag", tag]
    if push and move_alias:
        command += ["--tag", alias, "--push"]
    elif push:  # a PR build: its dated tag only; the rolling alias follows the main line alone
        command += ["--push"]
    else:
        command += ["--load"]
    command.append(context)
    tags = (tag, alias) if move_alias else (tag,)
    builds = source_build_lines(root, variant, config)
    return RefreshPlan(variant, tag, alias, inputs, context, tags, tuple(command), push, builds)


def source_build_lines(root: Path, variant: Variant, config: ImageConfig) -> tuple[str, ...]:
    """'<dist> (import <module>) from <repo> @ <pin value>, for GPU_ARCHS=<archs>' per source build."""
    args = {name: value for name, (value, _) in dockerfile_args(root / variant.dockerfile).items()}
    args.update(dict(variant.build_args))  # the variant's build args override the defaults
    archs = args.get("GPU_ARCHS")
    return tuple(
        f"{b.dist} (import {b.module}) from {b.repo} @ {args.get(b.pin, '<no ARG ' + b.pin + '>')}"
        + (f", for GPU_ARCHS={archs}" if archs else "")
        for b in config.stack(variant.stack).source_builds
    )


@dataclass(frozen=True)
class SourceBuildProblem:
    """A source build images.toml declares that the Dockerfile does not pin."""

    dist: str
    pin: str
    dockerfile: str

    def __str__(self) -> str:
        return (
            f"{self.dist}: {self.dockerfile} has no `ARG {self.pin}=<release or commit>`, and images.toml "
            f"(source_builds) says it pins the source {self.dist} is built from; add the ARG"
        )


def pins_problems(
    root: Path, variant: Variant, config: ImageConfig | None = None
) -> list[Mismatch | SourceBuildProblem | str]:
    """Where the variant's Dockerfile states a version its lock does not pin, leaves a source
    build unpinned, or builds one otherwise than its pinned source needs (miles.image.source_builds)."""
    config = config or load_images()
    stack = config.stack(variant.stack)
    lock = parse_lock(root / stack.lock_path, root=root)
    problems: list[Mismatch | SourceBuildProblem] = list(
        check_dockerfile(root / variant.dockerfile, lock, root=root)
    )
    args = dockerfile_args(root / variant.dockerfile, root=root)
    problems += [
        SourceBuildProblem(b.dist, b.pin, variant.dockerfile)
        for b in stack.source_builds
        if b.pin not in args
    ]
    if not problems:  # what the pinned sources need, once every pin is stated
        from miles.image.source_builds import source_build_problems

        problems += source_build_problems(root, variant, config)
    return problems


def subprocess_runner(command: Sequence[str]) -> tuple[int, str]:
    if shutil.which(command[0]) is None:
        raise ImageError(
            f"`{command[0]}` is not installed; refresh-image needs docker with buildx (or use --dry)"
        )
    done = subprocess.run(list(command), stdout=subprocess.PIPE, text=True)
    return done.returncode, done.stdout


def existing_image(plan: RefreshPlan, run: Runner) -> str | None:
    """The tag of an image already built from these inputs, or None.

    Raises when the dated tag exists with different inputs: that tag is never rebuilt.
    """
    for ref in plan.lookups:
        code, out = run(["docker", "buildx", "imagetools", "inspect", ref, "--format", "{{json .Image}}"])
        if code != 0:
            continue
        labels = image_labels(out)
        if labels.get(LABEL_HASH) == plan.inputs.digest:
            return labels.get(LABEL_TAG) or ref
        if ref == plan.tag:
            raise ImageError(
                f"{ref} exists with inputs hash {labels.get(LABEL_HASH)!r}, not {plan.inputs.digest}; "
                "a dated tag is never overwritten: investigate before building"
            )
    return None


def image_labels(inspect_json: str) -> dict[str, str]:
    """Labels from `imagetools inspect --format '{{json .Image}}'`, single or multi-platform."""
    data = json.loads(inspect_json or "{}")
    if "config" not in data and data and all(isinstance(v, dict) for v in data.values()):
        data = next(iter(data.values()))  # multi-platform: one config per platform, same labels
    return dict((data.get("config") or {}).get("Labels") or {})


def stage_context(root: Path, plan: RefreshPlan) -> Path:
    """Copy exactly the hashed inputs into the build context folder, replacing it."""
    context = root / plan.context
    if context.exists():
        shutil.rmtree(context)
    for path, _digest in plan.inputs.entries:
        if "#" in path:
            continue  # the variant's settings: passed as build args, not a file
        target = context / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / path, target)
    return context


@dataclass(frozen=True)
class RefreshResult:
    tag: str
    built: bool
    message: str


def refresh(root: Path, plan: RefreshPlan, run: Runner = subprocess_runner) -> RefreshResult:
    problems = pins_problems(root, plan.variant)
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise ImageError(f"{plan.variant.dockerfile} disagrees with its lock; fix one of them:\n{lines}")
    te_refusal(root, plan.variant)
    existing = existing_image(plan, run)
    if existing:
        return RefreshResult(existing, False, f"up to date: {existing} carries inputs {plan.inputs.short}")
    stage_context(root, plan)
    code, _out = run(list(plan.build))
    if code != 0:
        raise ImageError(
            f"docker buildx build failed with exit code {code}; the tag {plan.tag} was not written"
        )
    where = "pushed" if plan.push else "loaded locally"
    return RefreshResult(plan.tag, True, f"built {plan.tag} ({where})")


def te_refusal(root: Path, variant: Variant) -> None:
    """Refuse to build an image whose Transformer Engine parts disagree (miles.image.te)."""
    from miles.image.te import te_problems

    problems = te_problems(root, variant)
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise ImageError(f"{variant.dockerfile}: Transformer Engine is not stated consistently:\n{lines}")


# A script the image's own interpreter runs: every installed distribution and its version.
_LIST_PACKAGES = (
    "import json, importlib.metadata as m; "
    "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions() if d.metadata['Name']}))"
)


@dataclass(frozen=True)
class ImageCheck:
    tag: str
    lock: Lock
    mismatches: tuple[Mismatch, ...]
    extras: tuple[str, ...]  # installed, not in the lock (source builds such as ROCm kernels)
    missing_builds: tuple[str, ...] = ()  # source builds the stack declares that are not installed

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.missing_builds

    def render(self) -> str:
        head = f"{self.tag} against {self.lock.path}: "
        problems = len(self.mismatches) + len(self.missing_builds)
        if self.ok:
            out = [head + f"all {len(self.lock.pins)} pins installed"]
        else:
            out = [head + f"{problems} difference(s)"] + [f"  {m}" for m in self.mismatches]
            out += [
                f"  {name}: missing; the image builds it from source (images.toml source_builds)"
                for name in self.missing_builds
            ]
        if self.extras:
            out.append(f"  not in the lock (built in the image): {', '.join(self.extras)}")
        return "\n".join(out)


def check_image(
    root: Path, tag: str, *, variant: str | None = None, run: Runner = subprocess_runner
) -> ImageCheck:
    """Run the image and diff its installed packages against its stack's lock."""
    config = load_images()
    check_reference(tag)  # handed to docker as one argument: never shell text, whatever the variant
    variant_obj = config.variant(variant or parse_tag(tag).variant)
    lock = parse_lock(root / config.stack(variant_obj.stack).lock_path, root=root)
    code, out = run(["docker", "run", "--rm", "--entrypoint", "python", tag, "-c", _LIST_PACKAGES])
    if code != 0:
        raise ImageError(f"could not list packages in {tag} (docker run exited {code}); is the tag pulled?")
    installed = {normalize(k): v for k, v in json.loads(out).items()}
    builds = config.stack(variant_obj.stack).source_builds
    return ImageCheck(
        tag,
        lock,
        tuple(diff_installed(lock, installed)),
        tuple(extra_installed(lock, installed)),
        tuple(b.dist for b in builds if b.dist not in installed),
    )
