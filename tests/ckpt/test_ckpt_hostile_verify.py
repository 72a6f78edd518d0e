"""Verification of a prepared checkpoint has no off switch someone with write access to the
checkpoint (or to the digest cache's files) controls.

The issue's cases: with the `.miles-ckpt.json` of an --hf-checkpoint truncated, or a
--ref-load's deleted, a flipped shard trained with exit 0; a forged digest-cache entry (the
tampered file's identity beside the manifest's hash) was trusted; an unlisted
`model.safetensors` beside the index was what transformers loads while verification passed; a
corrupted staged copy was left in place by a rerun that reported success; a FIFO as the digest
cache hung and a deep-JSON or /dev/zero cache was a traceback. The trainer is run as a user
runs it (`python -m miles.train`); the other checks call the function the trainer calls before
any model loads (miles.train.inputs.checkpoint_problems) or the command a user types.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ckpt.cli import main
from miles.ckpt.manifest import MANIFEST_NAME, read_manifest
from miles.ckpt.pipeline import prepare
from miles.ckpt.plan import CheckpointPlan
from miles.ckpt.shards import INDEX_NAME, read_weight_map
from miles.ckpt.verify import DigestCache, file_problems, identity

register_cpu_ci(est_time=3, suite="stage-b-cpu")

RUN = (
    "--prompt-data synthetic:fixed --rm-type synthetic --num-rollout 1 --rollout-batch-size 2 "
    "--n-samples-per-prompt 2 --rollout-max-response-len 4 --global-batch-size 4 --micro-batch-size 4 "
    "--rollout-engine torch --train-backend fsdp --num-threads 1"
).split()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """This test's own digest cache (the user's is never touched)."""
    path = tmp_path / "digest-cache"
    monkeypatch.setenv("MILES_CACHE_DIR", str(path))
    return path


@pytest.fixture(scope="module")
def prepared_once(tmp_path_factory) -> Path:
    """A 2-layer qwen3 prepared by prepare-ckpt (fetch of a tiny source): folder and manifest."""
    models = tmp_path_factory.mktemp("verify-models")
    plan = CheckpointPlan("qwen3", "m", "tiny:qwen3", str(models), 2, ("fetch",))
    prepare(plan, progress=False)
    return Path(plan.hf_dir)


@pytest.fixture
def prepared(prepared_once, tmp_path) -> Path:
    """A private copy of it, under a path no digest cache has seen."""
    out = tmp_path / "hf"
    shutil.copytree(prepared_once, out)
    return out


def manifest_problems(directory: Path) -> list[str]:
    from miles.ckpt.verify import manifest_problems as problems

    return problems(directory)


def first_shard(root: Path) -> Path:
    return root / sorted(set(read_weight_map(root).weight_map.values()))[0]


def flip(path: Path, at: int | None = None) -> None:
    """One byte changed in place (same size)."""
    with open(path, "r+b") as f:
        f.seek(at if at is not None else path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def problems_of(hf: Path, ref_load: Path | None = None) -> list[str]:
    from miles.train.args import parse_config
    from miles.train.inputs import checkpoint_problems

    args = ["--hf-checkpoint", str(hf), *(["--ref-load", str(ref_load)] if ref_load else []), *RUN]
    return checkpoint_problems(parse_config(args))


def train(hf: Path, cache: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "miles.train", "--hf-checkpoint", str(hf), *RUN]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILES_CACHE_DIR": str(cache)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)


# --- the cases ----------------------------------------------------------------------


def test_a_truncated_manifest_and_a_flipped_shard_do_not_train(prepared, cache):
    manifest = prepared / MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes()[:40])
    flip(first_shard(prepared))
    done = train(prepared, cache)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("miles.train:")]
    assert line.startswith(
        f"miles.train: CheckpointRefused: --hf-checkpoint {prepared}: manifest {manifest} is damaged"
    )
    assert "without it the folder's files cannot be checked" in line, line


def test_a_ref_load_that_lost_its_manifest_after_a_verified_run_is_refused(prepared, tmp_path):
    ref = tmp_path / "ref"
    shutil.copytree(prepared, ref)
    assert problems_of(prepared, ref) == []  # verified once
    (ref / MANIFEST_NAME).unlink()
    flip(first_shard(ref))
    (line,) = problems_of(prepared, ref)
    assert line.startswith(
        f"--ref-load {ref}: {ref / MANIFEST_NAME} is missing, but {ref} was written or verified"
    )
    assert "nothing vouches for its files" in line, line


def test_a_forged_cache_entry_does_not_vouch_for_changed_bytes(prepared, cache):
    """The entry a forger writes: the tampered file's new identity beside the manifest's sha256."""
    assert manifest_problems(prepared) == []
    shard = first_shard(prepared)
    rel = shard.name
    flip(shard)
    path = DigestCache(prepared).path
    data = json.loads(path.read_text())
    data["files"][rel] = {**data["files"][rel], "id": identity(shard.stat())}
    data["files"][rel]["sha256"] = read_manifest(prepared).files[rel].sha256
    path.write_text(json.dumps(data))
    assert manifest_problems(prepared) == [
        f"{shard} is not the file that was written: its sha256 differs from the recorded one (changed in place)"
    ]


def test_an_unlisted_model_safetensors_beside_the_index_is_refused(prepared, capsys):
    shutil.copyfile(first_shard(prepared), prepared / "model.safetensors")
    (line,) = problems_of(prepared)
    assert f"{prepared / 'model.safetensors'}: not in {prepared / MANIFEST_NAME}" in line, line
    assert main(["validate", str(prepared), "--family", "qwen3", "--scan-nan", "0"]) == 1
    err = capsys.readouterr().err
    assert (
        f"{prepared / 'model.safetensors'}: [unlisted weights]" in err
        and f"{INDEX_NAME} does not list it" in err
    )


def test_a_corrupted_staged_copy_is_redone_by_a_rerun(tmp_path, capsys, tree_digest):
    models, stage = tmp_path / "models", tmp_path / "stage"
    argv = ["prepare", "--quiet", "--family", "qwen3", "--model", "m", "--source", "tiny:qwen3", "--layers", "2",
            "--model-dir", str(models), "--stage-dir", str(stage), "--plan-steps", "fetch,stage"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    flip(first_shard(stage / "m"))
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "stage       ran" in out and "copied" in out, out
    assert tree_digest(stage / "m") == tree_digest(models / "m")


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "deep JSON"])
def test_a_digest_cache_that_is_a_fifo_dev_zero_or_deep_json_is_no_cache(prepared, cache, kind):
    """Run in a child with a timeout: a cache read that blocks must fail the test, not hang it."""
    path = DigestCache(prepared).path
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path.symlink_to("/dev/zero")
    else:
        path.write_text('{"format": 2, "files": ' + "[" * 200_000 + "]" * 200_000 + "}")
    flip(first_shard(prepared))
    code = (
        "from miles.ckpt.manifest import read_manifest; from miles.ckpt.verify import file_problems; "
        f"d = {str(prepared)!r}; found = file_problems(d, read_manifest(d)); "
        "print(len(found)); print(found[0] if found else '')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MILES_CACHE_DIR": str(cache)}, check=False)  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    count, line = done.stdout.splitlines()
    assert count == "1" and "is not the file that was written" in line, done.stdout


# --- more of the same kind ------------------------------------------------------------------


def test_a_manifest_deleted_from_a_folder_prepare_wrote_here_is_refused_before_any_run(tmp_path):
    """No verified run is needed: the step that wrote the folder told the digest cache."""
    models = tmp_path / "models"
    plan = CheckpointPlan("qwen3", "m", "tiny:qwen3", str(models), 2, ("fetch",))
    prepare(plan, progress=False)
    (Path(plan.hf_dir) / MANIFEST_NAME).unlink()
    (line,) = problems_of(Path(plan.hf_dir))
    assert "is missing, but" in line and "written or verified with it on this machine" in line, line


def test_a_folder_that_never_had_a_manifest_is_left_to_its_own_checks(prepared):
    (prepared / MANIFEST_NAME).unlink()  # a copy made elsewhere, never seen here with one
    assert problems_of(prepared) == []


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "a folder"])
def test_a_manifest_that_is_not_a_regular_file_is_refused_at_once(prepared, kind):
    manifest = prepared / MANIFEST_NAME
    manifest.unlink()
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "/dev/zero":
        manifest.symlink_to("/dev/zero")
    else:
        manifest.mkdir()
    (line,) = problems_of(prepared)
    shown = {"fifo": "a FIFO", "/dev/zero": "a character device", "a folder": "a directory"}[kind]
    assert f"manifest {manifest} is {shown}, not a regular file" in line, line


def test_a_manifest_naming_a_file_outside_the_folder_is_damaged_not_absent(prepared):
    data = json.loads((prepared / MANIFEST_NAME).read_text())
    data["files"]["../outside.bin"] = {"size": 1, "sha256": "0" * 64}
    (prepared / MANIFEST_NAME).write_text(json.dumps(data))
    (line,) = problems_of(prepared)
    assert "'../outside.bin' climbs outside the folder" in line and "cannot be checked" in line, line


@pytest.mark.parametrize("content", ["", "null", "[]", '{"format": 1}', '{"format": 99, "files": {}}'])
def test_a_manifest_that_is_empty_or_not_one_is_refused(prepared, content):
    (prepared / MANIFEST_NAME).write_text(content)
    (line,) = problems_of(prepared)
    assert f"manifest {prepared / MANIFEST_NAME} is damaged" in line, line


def test_changed_bytes_behind_an_unchanged_identity_are_caught_by_the_sampled_windows(prepared, cache):
    """Bytes changed without a visible write (bit rot, a file system that keeps ctime): simulated
    by giving the cache's keyed entry the file's new identity, as such a file would keep it. The
    windows hashed with the entry, at offsets a forger cannot predict, no longer read back."""
    shard = first_shard(prepared)
    assert manifest_problems(prepared) == []
    entry_cache = DigestCache(prepared)
    old = entry_cache.entries[shard.name]
    with open(shard, "r+b") as f:  # every byte after the header, so every window sees a change
        f.seek(4096)
        f.write(bytes(b ^ 0x5A for b in shard.read_bytes()[4096:]))
    st = shard.stat()
    samples = old["samples"]
    mac = entry_cache._mac("file", shard.name, identity(st), old["sha256"], samples)
    entry_cache.entries[shard.name] = {
        "id": identity(st),
        "sha256": old["sha256"],
        "samples": samples,
        "mac": mac,
    }
    entry_cache.changed = True
    entry_cache.save()
    assert DigestCache(prepared).lookup(shard.name, st, shard) is None
    (line,) = manifest_problems(prepared)
    assert f"{shard} is not the file that was written" in line


def test_a_cache_key_others_can_read_is_not_used(prepared, cache):
    assert manifest_problems(prepared) == []
    (cache / "key").chmod(0o644)
    assert DigestCache(prepared).key is None
    flip(first_shard(prepared))
    assert len(manifest_problems(prepared)) == 1


def test_a_cache_key_that_is_a_symlink_is_not_used(prepared, cache, tmp_path):
    assert manifest_problems(prepared) == []
    real = tmp_path / "elsewhere-key"
    shutil.move(cache / "key", real)
    (cache / "key").symlink_to(real)
    assert DigestCache(prepared).key is None


def test_an_oversized_cache_file_is_not_read(prepared):
    path = DigestCache(prepared).path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB that would fill memory if read
    assert DigestCache(prepared).entries == {}
    assert manifest_problems(prepared) == []


def test_an_unlisted_file_in_a_subfolder_is_refused(prepared):
    (prepared / "extra").mkdir()
    (prepared / "extra" / "weights.bin").write_bytes(b"\0" * 16)
    (line,) = problems_of(prepared)
    assert f"{prepared / 'extra' / 'weights.bin'}: not in" in line, line


def test_a_planted_symlink_is_refused_and_never_followed(prepared, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (prepared / "linked").symlink_to(tmp_path / "elsewhere")
    (prepared / "tokenizer.model").symlink_to("/dev/zero")
    (line,) = problems_of(prepared)
    assert str(prepared / "linked") in line and str(prepared / "tokenizer.model") in line, line


def test_validate_refuses_a_pytorch_bin_beside_the_safetensors_index(prepared, capsys):
    (prepared / "pytorch_model.bin").write_bytes(b"\0" * 64)
    assert main(["validate", str(prepared), "--family", "qwen3", "--scan-nan", "0"]) == 1
    err = capsys.readouterr().err
    assert f"{prepared / 'pytorch_model.bin'}: [unlisted weights]" in err, err


def test_validate_refuses_a_second_shard_beside_a_single_model_safetensors(tmp_path, capsys):
    from miles.ckpt.tiny import make_tiny_checkpoint

    single = make_tiny_checkpoint("qwen3", 1, tmp_path / "single", shard_bytes=1 << 30, progress=False)
    assert (single / "model.safetensors").is_file() and not (single / INDEX_NAME).exists()
    shutil.copyfile(single / "model.safetensors", single / "model-00001-of-00002.safetensors")
    assert main(["validate", str(single), "--family", "qwen3", "--scan-nan", "0"]) == 1
    assert "[unlisted weights]" in capsys.readouterr().err


def test_a_staged_copy_with_a_planted_file_is_not_up_to_date(tmp_path, capsys):
    models, stage = tmp_path / "models", tmp_path / "stage"
    argv = ["prepare", "--quiet", "--family", "qwen3", "--model", "m", "--source", "tiny:qwen3", "--layers", "2",
            "--model-dir", str(models), "--stage-dir", str(stage), "--plan-steps", "fetch,stage"]  # fmt: skip
    assert main(argv) == 0
    shutil.copyfile(first_shard(stage / "m"), stage / "m" / "model.safetensors")
    capsys.readouterr()
    assert main(argv) == 0
    assert "stage       ran" in capsys.readouterr().out
    assert not (stage / "m" / "model.safetensors").exists()
    assert file_problems(stage / "m", read_manifest(stage / "m")) == []


def test_staging_a_source_changed_since_its_manifest_is_refused(tmp_path, capsys):
    models, stage = tmp_path / "models", tmp_path / "stage"
    argv = ["prepare", "--quiet", "--family", "qwen3", "--model", "m", "--source", "tiny:qwen3", "--layers", "2",
            "--model-dir", str(models), "--plan-steps", "fetch"]  # fmt: skip
    assert main(argv) == 0
    flip(first_shard(models / "m"))
    from miles.ckpt.errors import CheckpointError
    from miles.ckpt.stage import stage_dir

    with pytest.raises(CheckpointError, match="is not the file its step wrote"):
        stage_dir(models / "m", stage / "m")
    assert not (stage / "m").exists()
