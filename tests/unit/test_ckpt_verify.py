"""A prepared directory's files are checked against its manifest, hashing a file again only when it changed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ckpt.manifest import read_manifest, write_manifest
from miles.ckpt.verify import CACHE_ENV, DigestCache, file_problems

register_cpu_ci(est_time=1, suite="stage-a-cpu")


@pytest.fixture
def prepared(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    out = tmp_path / "model"
    (out / "release").mkdir(parents=True)
    (out / "release" / "weights.bin").write_bytes(bytes(range(256)) * 64)
    (out / "config.json").write_text('{"a": 1}')
    write_manifest(out, "torch_dist", "inputs", {})
    return out


def problems(directory: Path) -> list[str]:
    return file_problems(directory, read_manifest(directory))


def test_an_untouched_directory_passes(prepared):
    assert problems(prepared) == []
    assert problems(prepared) == []  # again, from the digest cache


def test_a_file_overwritten_in_place_with_its_size_and_mtime_kept_is_found(prepared):
    target = prepared / "release" / "weights.bin"
    assert problems(prepared) == []  # its digest is cached now
    st = target.stat()
    with open(target, "r+b") as f:
        f.seek(1000)
        f.write(b"\xff" * 16)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # the modification time put back
    assert target.stat().st_size == st.st_size
    assert problems(prepared) == [
        f"{target} is not the file that was written: its sha256 differs from the recorded one (changed in place)"
    ]


def test_a_truncated_and_a_missing_file_are_each_named(prepared):
    (prepared / "release" / "weights.bin").write_bytes(b"short")
    (prepared / "config.json").unlink()
    assert problems(prepared) == [
        f"{prepared / 'config.json'} is missing (the manifest lists it, 8 bytes)",
        f"{prepared / 'release' / 'weights.bin'} is 5 bytes, but 16384 were written (truncated or replaced)",
    ]


def test_an_unchanged_file_is_not_read_again(prepared):
    """The cache is trusted while the file's identity (inode, size, mtime, ctime) is unchanged:
    a wrong digest stored through the cache itself (keyed, so only this user can) is believed,
    and one touch of the file makes it hash again."""
    assert problems(prepared) == []
    target = prepared / "release" / "weights.bin"
    cache = DigestCache(prepared)
    cache.store("release/weights.bin", target.stat(), target, "0" * 64)
    cache.save()
    assert len(problems(prepared)) == 1  # believed: nothing was read
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # same times, but the change time moves
    assert problems(prepared) == []


def test_an_unwritable_cache_means_hashing_in_full(prepared, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))
    assert problems(prepared) == []
    (prepared / "config.json").write_text('{"a": 2}')
    assert len(problems(prepared)) == 1


def test_a_dcp_directory_missing_its_index_or_holding_a_short_file_is_named(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from miles.ckpt.verify import dcp_problems

    dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    data = next((tmp_path / "ck").glob("*.distcp"))
    assert dcp_problems(tmp_path / "ck") == []
    with open(data, "r+b") as f:
        f.truncate(100)
    assert dcp_problems(tmp_path / "ck") == [
        f"{data} is 100 bytes, but its tensors end at byte {_end(tmp_path / 'ck')} (truncated)"
    ]
    (tmp_path / "ck" / ".metadata").unlink()
    assert dcp_problems(tmp_path / "ck") == [
        f"{tmp_path / 'ck' / '.metadata'} is missing (the index of the checkpoint's tensor files)"
    ]


def _end(directory: Path) -> int:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(directory)).read_metadata()
    return max(i.offset + i.length for i in metadata.storage_data.values())
