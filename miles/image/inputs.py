"""What an image is built from, and the hash and tag that name it.

The input hash is SHA-256 over (path, SHA-256 of content) of every file the build reads:
the variant's Dockerfile, its stack's lock, its patches and the shared build scripts, plus
the variant's own settings. The tag `<image>:<variant>-<YYYYMMDD>-<hash8>` is dated and
content-addressed, so the same inputs never hide behind a moving name.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from miles.image.config import ImageConfig, Variant

LABEL_HASH = "dev.miles.inputs-hash"
LABEL_VARIANT = "dev.miles.variant"
LABEL_TAG = "dev.miles.image-tag"

_TAG = re.compile(r"^(?P<image>.+):(?P<variant>[a-z0-9][a-z0-9-]*)-(?P<date>\d{8})-(?P<hash8>[0-9a-f]{8})$")


class InputsError(ValueError):
    """A file the variant names is missing."""


@dataclass(frozen=True)
class InputHash:
    digest: str  # full hex SHA-256
    entries: tuple[tuple[str, str], ...]  # (path, content sha256), sorted by path

    @property
    def short(self) -> str:
        return self.digest[:8]


def variant_inputs(root: Path, variant: Variant, config: ImageConfig) -> list[str]:
    """Project-relative paths of every file the variant's build reads, sorted."""
    stack = config.stack(variant.stack)
    paths = {variant.dockerfile, stack.lock_path, *config.build_scripts}
    for folder in variant.patches:
        directory = root / folder
        if not directory.is_dir():
            raise InputsError(f"variant '{variant.name}': patch directory {folder} does not exist")
        paths.update(p.relative_to(root).as_posix() for p in directory.rglob("*") if p.is_file())
    missing = sorted(p for p in paths if not (root / p).is_file())
    if missing:
        raise InputsError(f"variant '{variant.name}' needs {', '.join(missing)}, which do not exist")
    return sorted(paths)


def input_hash(root: Path, variant: Variant, config: ImageConfig) -> InputHash:
    entries = [(p, _file_sha256(root / p)) for p in variant_inputs(root, variant, config)]
    settings = json.dumps({"image": config.image, "variant": asdict(variant)}, sort_keys=True)
    entries.append((f"images.toml#variants.{variant.name}", hashlib.sha256(settings.encode()).hexdigest()))
    entries.sort()
    outer = hashlib.sha256()
    for path, digest in entries:
        # NUL and newline cannot occur in paths we accept, so the encoding is unambiguous.
        outer.update(f"{path}\0{digest}\n".encode())
    return InputHash(outer.hexdigest(), tuple(entries))


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def image_tag(image: str, variant: str, date: dt.date, digest: str) -> str:
    return f"{image}:{variant}-{date:%Y%m%d}-{digest[:8]}"


def alias_tag(image: str, variant: str) -> str:
    """The rolling name that points at the newest dated tag; never the only name of an image."""
    return f"{image}:{variant}"


@dataclass(frozen=True)
class ParsedTag:
    image: str
    variant: str
    date: str
    hash8: str


class BadTag(ValueError):
    """An image tag that is not a container image reference, or not one miles writes; bad input."""


# A container image reference as docker reads it: registry/path:tag or @digest, no spaces or shell text.
_REFERENCE = re.compile(r"[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?")


def check_reference(tag: str) -> str:
    """`tag` if it is a container image reference (lowercase path, an optional :tag and @digest)."""
    if not _REFERENCE.fullmatch(tag):
        raise BadTag(
            f"image tag {tag!r} is not an image reference (registry/name:tag, lowercase path, no spaces or "
            "shell characters)"
        )
    return tag


def parse_tag(tag: str) -> ParsedTag:
    match = _TAG.match(check_reference(tag))
    if not match:
        raise BadTag(f"image tag {tag!r} is not <image>:<variant>-<YYYYMMDD>-<hash8>")
    return ParsedTag(match["image"], match["variant"], match["date"], match["hash8"])
