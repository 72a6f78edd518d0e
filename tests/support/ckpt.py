"""Tiny checkpoints and their torch_dist forms for tests: from the cache a lane run shares.

Every test file of a lane run (and every test of one pytest session) asks the same cache
(miles.ckpt.tiny_cache, in `$MILES_TINY_CACHE`: the runner sets one per lane run; without it the
first test to ask makes one for its process and the processes it starts, removed at exit), so a
family and size is built once and verified on every use.
A cached checkpoint is shared: a test that changes one works on `private(...)`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from miles.ckpt.tiny_cache import CACHE_ENV, TinyCheckpoint, copy_of, tiny_checkpoint


def cache_folder() -> Path:
    given = os.environ.get(CACHE_ENV)
    if not given:
        given = tempfile.mkdtemp(prefix="miles-tiny-")
        os.environ[CACHE_ENV] = given  # the processes the tests start share it
        atexit.register(shutil.rmtree, given, True)
    return Path(given)


def tiny(family: str, layers: int, *, torch_dist: bool = False, **kwargs: Any) -> TinyCheckpoint:
    """The tiny `family` checkpoint of `layers` layers (make_tiny_checkpoint's keywords), and its
    torch_dist form with `torch_dist`."""
    return tiny_checkpoint(family, layers, torch_dist=torch_dist, root=cache_folder(), **kwargs)


def tiny_hf(family: str, layers: int, **kwargs: Any) -> Path:
    return tiny(family, layers, **kwargs).hf


def private(entry: Path, into: Path) -> Path:
    """A copy of a cached folder that the test may change."""
    return copy_of(entry, into)
