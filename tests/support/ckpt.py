"""Tiny checkpoints and their torch_dist forms for tests: from the cache a lane run shares.

Every test file of a lane run (and every test of one pytest session) asks the same cache
(miles.ckpt.tiny_cache, in `$MILES_TINY_CACHE`: the runner sets one per lane run, tests/conftest.py
one per session when none is set), so a family and size is built once and verified on every use.
A cached checkpoint is shared: a test that changes one works on `private(...)`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from miles.ckpt.tiny_cache import CACHE_ENV, TinyCheckpoint, copy_of, tiny_checkpoint


def cache_folder() -> Path:
    return Path(os.environ[CACHE_ENV])


def tiny(family: str, layers: int, *, torch_dist: bool = False, **kwargs: Any) -> TinyCheckpoint:
    """The tiny `family` checkpoint of `layers` layers (make_tiny_checkpoint's keywords), and its
    torch_dist form with `torch_dist`."""
    return tiny_checkpoint(family, layers, torch_dist=torch_dist, root=cache_folder(), **kwargs)


def tiny_hf(family: str, layers: int, **kwargs: Any) -> Path:
    return tiny(family, layers, **kwargs).hf


def private(entry: Path, into: Path) -> Path:
    """A copy of a cached folder that the test may change."""
    return copy_of(entry, into)
