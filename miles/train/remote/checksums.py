"""Checksums of tensors' bytes: what the disk transfer records and the weight check compares.

`tensor_checksum` is sglang 0.5.23's CPU `tensor_hash` as its `/weights_checker` prints it
(managers/mm_utils.py: the first 8 bytes of the SHA-256 of the tensor's bytes, big-endian,
as 16 hex digits), so the built-in engine server answers `/weights_checker` the way SGLang does.
`digest(kind)` is the checksum a disk transfer records per tensor and per file
(--update-weight-delta-checksum): sha256 and adler32 from the standard library, xxh3-128 and
blake3 from their packages when installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import zlib
from collections.abc import Callable

NEEDS_PACKAGE = {"xxh3-128": "xxhash", "blake3": "blake3"}


def tensor_bytes(tensor) -> memoryview:
    """The tensor's bytes as it is laid out in memory (contiguous, on the CPU)."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def tensor_checksum(tensor) -> str:
    """SGLang's weight checksum of one tensor (see the module docstring)."""
    value = int.from_bytes(hashlib.sha256(tensor_bytes(tensor)).digest()[:8], "big")
    return f"{value:016x}"


def missing_package(kind: str) -> str | None:
    """The package checksum `kind` needs and lacks here, or None."""
    package = NEEDS_PACKAGE.get(kind)
    return package if package and importlib.util.find_spec(package) is None else None


def digest(kind: str) -> Callable[[bytes | memoryview], str]:
    """The hex digest function of --update-weight-delta-checksum `kind`."""
    if kind == "sha256":
        return lambda data: hashlib.sha256(data).hexdigest()
    if kind == "adler32":
        return lambda data: f"{zlib.adler32(data):08x}"
    if kind == "xxh3-128":
        import xxhash

        return lambda data: xxhash.xxh3_128_hexdigest(bytes(data))
    if kind == "blake3":
        import blake3

        return lambda data: blake3.blake3(bytes(data)).hexdigest()
    raise ValueError(f"unknown checksum {kind!r}; known: sha256, adler32, xxh3-128, blake3")
