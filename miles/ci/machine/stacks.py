"""images.toml read with the catalog's lanes: which pinned stack a lane runs, with its Python.

miles.image knows stacks and variants, not lanes; the CI passes its lanes in here, so the two
packages depend one way (miles.ci -> miles.image).
"""

from __future__ import annotations

from miles.ci.registry.catalog import Catalog, load_catalog
from miles.image.config import ImageConfig, LaneFacts, Stack, load_images


def lane_facts(catalog: Catalog | None = None) -> tuple[LaneFacts, ...]:
    """Every lane of the catalog as images.toml needs it (name, backend, Python)."""
    catalog = catalog or load_catalog()
    return tuple(LaneFacts(lane.name, lane.backend, lane.python) for lane in catalog.lanes.values())


def image_config(catalog: Catalog | None = None) -> ImageConfig:
    """images.toml, checked against the catalog's lanes (a stack per lane name and backend)."""
    return load_images(lanes=lane_facts(catalog))


def stack_for_lane(lane: str, catalog: Catalog | None = None) -> Stack:
    """The pinned stack a lane runs: the one of the lane's backend."""
    catalog = catalog or load_catalog()
    return image_config(catalog).stack_of_backend(catalog.lane(lane).backend)
