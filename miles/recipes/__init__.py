"""Training recipes as data, their platform overlays, and the launcher.

    from miles.recipes import load
    recipe = load("inkling")                 # the form for this machine's platform
    plan = recipe.checkpoint_plan("Inkling-Small-4layer")

`load()` dispatches on the platform `miles.platform.resolve()` reports (which cross-checks
`MILES_HARDWARE_PLATFORM` against torch): tests get their recipe through it, never through an
environment-variable import switch. The recipes live in `miles/recipes/library/`, one module
each with the models it trains (found there, never listed by hand), the reference recipes they
follow in `miles/recipes/references/`; the scripts in `scripts/` and `scripts/amd/` are their
command lines.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Mapping

from miles.recipes import library
from miles.recipes.recipe import GROUPS, Overlay, ParallelProfile, Recipe, RecipeError

# One module of miles/recipes/library/ per recipe, by its name.
NAMES: tuple[str, ...] = tuple(sorted(m.name for m in pkgutil.iter_modules(library.__path__)))


class UnknownRecipe(RecipeError):
    pass


def names() -> tuple[str, ...]:
    return NAMES


def shared(name: str) -> Recipe:
    """The shared form of a recipe (CUDA and the CPU tiny profile)."""
    key = name.replace("-", "_").lower()
    if key not in NAMES:
        raise UnknownRecipe(f"unknown recipe '{name}'; known: {', '.join(NAMES)}")
    return importlib.import_module(f"miles.recipes.library.{key}").RECIPE


def load(name: str, platform: str | None = None, env: Mapping[str, str] = os.environ) -> Recipe:
    """The recipe for `platform`, or for this machine when None (MILES_HARDWARE_PLATFORM is
    honoured but must agree with torch: `PlatformMismatch` names both facts otherwise)."""
    recipe = shared(name)
    if platform is None:
        from miles.platform import resolve

        platform = resolve(env).platform
    return recipe.for_platform(str(platform))


def variants(name: str) -> tuple[Recipe, ...]:
    """The shared form and every platform form of a recipe."""
    recipe = shared(name)
    return (recipe, *(recipe.for_platform(o.platform) for o in recipe.overlays))


__all__ = [
    "GROUPS",
    "NAMES",
    "Overlay",
    "ParallelProfile",
    "Recipe",
    "RecipeError",
    "load",
    "names",
    "shared",
    "variants",
]
