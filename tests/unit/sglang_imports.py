"""Make the installed sglang importable on a machine without its GPU stack (test helper).

Importing sglang's scheduler, tokenizer manager or engine modules pulls in two packages the
cpu lane cannot hold: triton (GPU kernel compiler; its wheel is ~250 MB and megatron-core
changes code paths when it finds one) and torchvision (built against the GPU lanes' torch,
not the cpu lane's; sglang imports it for multimodal image preprocessing). Both get an
import-only stand-in: a module whose attributes are modules, classes or pass-through
decorators, never code, like the stand-ins sglang ships for machines without triton
(sglang/_platform_stubs.py). Nothing the tests run executes a kernel or an image transform.

torch and transformers are imported first, so both keep seeing neither package (torch's
inductor records triton's absence at import, transformers its torchvision check). Every
other package sglang imports is the GPU lanes' own version (requirements/cpu-sglang.txt).
Use in a process of its own: importing sglang also patches transformers.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAND_INS = ("triton", "torchvision")


def pinned(package: str, lock: str = "requirements/cuda-h200.txt") -> str:
    """The GPU lanes' version of `package` (the stand-in reports it)."""
    match = re.search(rf"^{package}==(\S+)$", (ROOT / lock).read_text(), re.MULTILINE)
    return match.group(1) if match else "0"


class _AnyAttribute(type):
    """A class whose attributes are classes too (`InterpolationMode.BICUBIC`, `tl.constexpr`) and
    whose instances take any arguments (`triton.Config(...)` in a decorator's argument list)."""

    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _any_class(attr)

    def __getitem__(cls, item):
        return cls


def _any_class(name: str) -> type:
    return _AnyAttribute(name, (), {"__init__": lambda self, *args, **kwargs: None})


class ImportOnly(types.ModuleType):
    """A module whose attributes are modules, classes or pass-through decorators, never code."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []
        self.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        if "." not in name:
            self.__version__ = pinned(name)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr[:1].isupper():
            return _any_class(attr)
        child = ImportOnly(f"{self.__name__}.{attr}")
        sys.modules[child.__name__] = child
        return child

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = tuple(names)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return ImportOnly(spec.name)

    def exec_module(self, module):
        pass


def missing_requirements() -> list[str]:
    """Packages of requirements/cpu-sglang.txt this interpreter cannot import."""
    from importlib import metadata

    missing = []
    for line in (ROOT / "requirements/cpu-sglang.txt").read_text().splitlines():
        name = line.split("==")[0].strip()
        if name and not name.startswith("#"):
            try:
                metadata.version(name)
            except metadata.PackageNotFoundError:
                missing.append(name)
    return missing


def install() -> None:
    """Stand-ins for the GPU-only packages that are absent; call before importing sglang."""
    import torch._inductor.compile_fx  # noqa: F401 (records that triton is absent)
    import transformers  # noqa: F401 (records that torchvision is absent)

    absent = [n for n in STAND_INS if n not in sys.modules and importlib.util.find_spec(n) is None]
    if absent:
        sys.meta_path.insert(0, _StandInFinder(absent))
