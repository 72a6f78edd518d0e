"""Collect each test file only where its registrations say it runs (see the plugin)."""

import pytest

pytest_plugins = ("miles.ci.pytest_plugin", "pytester")


# What Inkling's recipe declared while miles' Megatron backend did not build it.
INKLING_FALLBACK_REASON = (
    "miles' Megatron backend does not build Inkling yet (short convolutions, relative attention bias "
    "and its shared experts are not in megatron-core 0.16.1); FSDP trains the HF model on the same GPUs, "
    "data-parallel"
)


@pytest.fixture
def inkling_unbuilt(monkeypatch):
    """The recipes as they were while miles' Megatron backend did not build Inkling: its family
    marked as one megatron-core does not build and its recipe declaring the FSDP fallback it had (and its CPU
    profile the default tiny one, which trains such a family with FSDP). Every shipped
    family is built now; the fallback machinery is for the next family that is not, and these
    tests hold it to what it did for Inkling. Returns the recipe with its fallback."""
    from dataclasses import replace

    import miles.recipes.library.inkling as library
    from miles.families import family
    from miles.recipes.recipe import Fallback

    monkeypatch.setattr(type(family("inkling")), "megatron", False)
    from miles.recipes import defaults

    profiles = tuple(
        defaults.cpu_tiny_profile() if p.platform == "cpu" else p for p in library.RECIPE.profiles
    )
    recipe = replace(library.RECIPE, profiles=profiles, fallback=Fallback("fsdp", INKLING_FALLBACK_REASON))
    monkeypatch.setattr(library, "RECIPE", recipe)
    return recipe
