"""Weight versions on disk (miles.train.remote.disk): full and delta, checksummed, resumable,
applied to an engine host's own copy bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.train.remote import disk
from miles.train.remote.checksums import tensor_checksum
from miles.train.remote.disk import Publisher, WeightFilesError, apply_version, read_weights, version_dir

register_cpu_ci(est_time=1, suite="stage-a-cpu")


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(16, 8, generator=g),
        "layer.0.proj.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "layer.0.norm.weight": torch.ones(8),
        "step": torch.arange(4, dtype=torch.int64),
    }


def _moved(weights: dict[str, torch.Tensor], *names: str) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in weights.items()}
    for name in names:
        out[name] = out[name] + torch.full_like(out[name], 0.25)
    return out


def _bits_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
    )


def test_a_full_version_reads_back_bit_for_bit_and_names_every_tensor(tmp_path):
    weights = _weights()
    path = Publisher(tmp_path / "pub", bucket_bytes=300).publish(weights.items(), 0)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["kind"] == "full" and len(manifest["files"]) > 1  # buckets of ~300 bytes: several shards
    assert {n: e["checksum"] for n, e in manifest["tensors"].items()} == {
        n: tensor_checksum(t) for n, t in weights.items()
    }
    assert _bits_equal(dict(read_weights(path)), weights)


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_a_delta_holds_only_the_changed_tensors_and_patches_the_local_copy_exactly(tmp_path, encoding):
    publisher = Publisher(tmp_path / "pub", delta=True, encoding=encoding)
    local = tmp_path / "local"
    first = _weights()
    apply_version(publisher.publish(first.items(), 0), local)
    second = _moved(first, "layer.0.proj.weight")
    path = publisher.publish(second.items(), 1)
    manifest = json.loads((path / "manifest.json").read_text())
    assert (manifest["kind"], manifest["base"], manifest["encoding"]) == ("delta", 0, encoding)
    assert list(manifest["tensors"]) == ["layer.0.proj.weight"]
    assert apply_version(path, local) == 1
    assert _bits_equal(dict(read_weights(local)), second)


def test_an_xor_delta_applied_twice_is_applied_once(tmp_path):
    publisher = Publisher(tmp_path / "pub", delta=True, encoding="xor")
    local = tmp_path / "local"
    apply_version(publisher.publish(_weights().items(), 0), local)
    second = _moved(_weights(), "embed.weight")
    path = publisher.publish(second.items(), 1)
    apply_version(path, local)
    apply_version(path, local)  # a second engine on the host pulls the same version
    assert _bits_equal(dict(read_weights(local)), second)


def test_an_apply_interrupted_after_staging_resumes_to_the_same_result(tmp_path, monkeypatch):
    publisher = Publisher(tmp_path / "pub", delta=True, encoding="xor", bucket_bytes=200)
    local = tmp_path / "local"
    apply_version(publisher.publish(_weights().items(), 0), local)
    second = _moved(_weights(), "embed.weight", "layer.0.norm.weight")
    path = publisher.publish(second.items(), 1)

    real_replace, renamed = os.replace, []

    def crash_after_one_file(src, dst):
        if str(src).endswith(".safetensors") and ".staging-" in str(src):
            if renamed:
                raise KeyboardInterrupt("the host went down mid-apply")
            renamed.append(dst)
        return real_replace(src, dst)

    monkeypatch.setattr(disk.os, "replace", crash_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        apply_version(path, local)
    monkeypatch.setattr(disk.os, "replace", real_replace)
    assert renamed, "the crash should land between two renamed files"
    assert disk.local_version(local) == 0  # the copy still says its old version
    assert apply_version(path, local) == 1
    assert _bits_equal(dict(read_weights(local)), second)


def test_a_delta_on_the_wrong_base_is_refused_before_anything_changes(tmp_path):
    publisher = Publisher(tmp_path / "pub", delta=True)
    local = tmp_path / "local"
    publisher.publish(_weights().items(), 0)
    publisher.publish(_moved(_weights(), "embed.weight").items(), 1)
    with pytest.raises(WeightFilesError, match="a delta from version 0, but .* holds no version"):
        apply_version(version_dir(tmp_path / "pub", 1), local)


def test_a_damaged_shard_is_named_and_not_loaded(tmp_path):
    path = Publisher(tmp_path / "pub").publish(_weights().items(), 3)
    shard = next(path.glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(WeightFilesError, match=f"{shard.name}: checksum .* is not the manifest's"):
        list(read_weights(path))


def test_an_interrupted_publish_is_invisible_and_its_rerun_keeps_the_written_shards(tmp_path):
    weights = _weights()
    publisher = Publisher(tmp_path / "pub", bucket_bytes=200)

    def dies_midway():
        for i, item in enumerate(weights.items()):
            if i == 3:
                raise KeyboardInterrupt("the trainer went down mid-publish")
            yield item

    with pytest.raises(KeyboardInterrupt):
        publisher.publish(dies_midway(), 5)
    assert not version_dir(tmp_path / "pub", 5).exists()
    partial = tmp_path / "pub" / ".v00000005.partial"
    written = {p.name: p.stat().st_mtime_ns for p in partial.glob("shard-*.safetensors")}
    assert written
    path = publisher.publish(weights.items(), 5)
    assert _bits_equal(dict(read_weights(path)), weights)
    assert {n: (path / n).stat().st_mtime_ns for n in written} == written  # not written again


def test_only_the_newest_versions_stay_on_disk(tmp_path):
    publisher = Publisher(tmp_path / "pub", keep=2)
    for version in range(4):
        publisher.publish(_moved(_weights(), *(["embed.weight"] * version)).items(), version)
    assert sorted(p.name for p in (tmp_path / "pub").iterdir()) == ["v00000002", "v00000003"]
