"""How a lane session installs its stack: the arguments, and a warning when a source is missing.

nox installs with uv when it is present and pip otherwise. pip reads its own settings
(PIP_FIND_LINKS, PIP_EXTRA_INDEX_URL, pip.conf); uv reads none of them, so they are passed
through as arguments. That is how a local wheel folder or a torch build index reaches either.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from miles.image.config import Stack
from miles.image.pins import parse_lock

SOURCE_VARS = (
    "PIP_FIND_LINKS",
    "PIP_EXTRA_INDEX_URL",
    "PIP_INDEX_URL",
    "UV_FIND_LINKS",
    "UV_EXTRA_INDEX_URL",
)


def install_arguments(stack: Stack, root: Path, *, venv_backend: str, env: Mapping[str, str]) -> list[str]:
    """Arguments for `session.install` that install exactly the stack's lock."""
    args: list[str] = []
    if venv_backend == "uv":
        args += find_links_arguments(env)
        extra = env.get("PIP_EXTRA_INDEX_URL", "").split()
        for url in extra:
            args += ["--extra-index-url", url]
        if extra:
            # a torch index also carries numpy & co.; let versions, not index order, decide
            args += ["--index-strategy", "unsafe-best-match"]
    if stack.exclude and stack.backend != "cpu":
        # The lock leaves out packages on purpose (CUDA kernels on ROCm): it is the whole set.
        # The cpu lock leaves out only what PyPI's torch build needs and the CPU build does not:
        # whichever build the installer takes brings what it needs.
        args.append("--no-deps")
    return [*args, "-r", str(root / stack.lock_path)]


def find_links_arguments(env: Mapping[str, str]) -> list[str]:
    """pip's PIP_FIND_LINKS (space separated), which uv does not read, as uv arguments."""
    return [arg for location in env.get("PIP_FIND_LINKS", "").split() for arg in ("--find-links", location)]


def torch_source_warning(stack: Stack, root: Path, env: Mapping[str, str]) -> str | None:
    """A hint when nothing points the installer at the stack's torch index: needed for a build
    outside PyPI (ROCm), worth knowing for a public pin whose PyPI build is the large
    CUDA-capable one while the index has a CPU-only build of the same version."""
    lock = parse_lock(root / stack.lock_path, root=root)
    torch = lock.pins.get("torch")
    if torch is None or any(env.get(v) for v in SOURCE_VARS):
        return None
    if "+" in torch.version:
        return (
            f"{lock.where('torch')} pins torch=={torch.version}, which PyPI does not publish; set "
            f"PIP_EXTRA_INDEX_URL={stack.torch_index} (or PIP_FIND_LINKS to a folder holding the wheel)"
        )
    if stack.torch_index.rstrip("/") == "https://pypi.org/simple":
        return None
    return (
        f"{lock.where('torch')} pins torch=={torch.version}: PyPI serves its CUDA-capable build (with "
        f"CUDA libraries, several GB); set PIP_EXTRA_INDEX_URL={stack.torch_index} for the CPU-only "
        f"build of the same version"
    )
