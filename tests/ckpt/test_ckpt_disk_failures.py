"""Full, read-only and forbidden disks: one line, a non-zero exit, nothing half-done looking done,
and once the disk is fixed a rerun ends with the bytes of a run that never failed.

The disks are real. A small tmpfs (`mount -t tmpfs -o size=...`) runs full in the middle of
a step and is then grown with `mount -o remount,size=...`; a read-only bind mount refuses
every write; a directory with mode 0555 refuses a run that cannot override file modes (a
non-root user, or root after dropping CAP_DAC_OVERRIDE in the child).
Mounting needs root (CAP_SYS_ADMIN): where it is refused, those tests skip and say so.
The failing runs are the real CLI (`python -m miles.ckpt prepare`), whose stderr is read.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ckpt.manifest import read_manifest
from miles.ckpt.pipeline import prepare
from miles.ckpt.plan import CheckpointPlan
from tests.support.ckpt import private

register_cpu_ci(est_time=25, suite="stage-b-cpu")

MODEL = "qwen3-tiny-4layer"
STEPS = ("fetch", "validate", "fp8", "torch_dist")
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2  # <linux/prctl.h>, <linux/capability.h>


def _plan(model_dir: Path, source: Path, stage_dir: Path | None = None) -> CheckpointPlan:
    steps = STEPS + (("stage",) if stage_dir else ())
    return CheckpointPlan(
        "qwen3", MODEL, str(source), str(model_dir), 4, steps, str(stage_dir) if stage_dir else None
    )


def _cli(plan: CheckpointPlan, *, preexec=None) -> subprocess.CompletedProcess:
    argv = [
        sys.executable, "-m", "miles.ckpt", "prepare", "--quiet", "--family", plan.family, "--model", MODEL,
        "--source", plan.source, "--model-dir", plan.model_dir, "--layers", "4",
        "--plan-steps", ",".join(plan.steps),
    ]  # fmt: skip
    if plan.stage_dir:
        argv += ["--stage-dir", plan.stage_dir]
    return subprocess.run(argv, capture_output=True, text=True, preexec_fn=preexec, check=False)


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


def _outputs(plan: CheckpointPlan) -> list[Path]:
    dirs = [Path(plan.hf_dir), Path(plan.fp8_dir), Path(plan.torch_dist_dir)]
    return dirs + ([Path(plan.stage_dir) / d.name for d in dirs] if plan.stage_dir else [])


def _digest(plan: CheckpointPlan, tree_digest) -> dict[str, dict[str, str]]:
    """{hf, fp8, torch_dist, staged hf, ...: {file: sha256}}, independent of where they live."""
    kinds = ("hf", "fp8", "torch_dist", "staged hf", "staged fp8", "staged torch_dist")
    return {kind: tree_digest(d) for kind, d in zip(kinds, _outputs(plan), strict=False)}


def _same_as_reference(plan: CheckpointPlan, ref: CheckpointPlan, tree_digest) -> None:
    got, want = _digest(plan, tree_digest), _digest(ref, tree_digest)
    assert got == {k: want[k] for k in got}


def _nothing_half_done(plan: CheckpointPlan) -> None:
    for d in _outputs(plan):  # a directory under its final name is complete, or absent
        assert not d.exists() or read_manifest(d) is not None, d
    leftovers = [p for p in Path(plan.model_dir).iterdir() if ".partial-" in p.name]
    assert leftovers == [], leftovers


def _mount(*argv: str) -> None:
    done = subprocess.run(["mount", *argv], capture_output=True, text=True, check=False)
    if done.returncode:
        pytest.skip(f"`mount {' '.join(argv)}` was refused ({done.stderr.strip()}); these tests need root")


@contextmanager
def _tmpfs(where: Path, size: int) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where))
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _pages(path: Path) -> int:
    """Bytes a tree takes on tmpfs: every file rounded up to 4 KiB pages."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in path.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """A qwen3 source outside the test disks, and the outputs of a run that never failed."""
    root = tmp_path_factory.mktemp("disk-ref")
    source = root / "source"
    private(tiny("qwen3"), source)
    plan = _plan(root / "models", source, root / "stage")
    prepare(plan, progress=False)
    return source, plan


@pytest.mark.parametrize("step", ["fetch", "fp8", "torch_dist", "stage"])
def test_a_full_disk_mid_step_is_one_line_and_a_rerun_after_growing_it_is_byte_identical(
    reference, tmp_path, tree_digest, step
):
    source, ref = reference
    hf, fp8, td = (_pages(Path(d)) for d in (ref.hf_dir, ref.fp8_dir, ref.torch_dist_dir))
    slack = 64 << 10  # the plan's lock and validation record, and page rounding
    before = {"fetch": 0, "fp8": hf + slack, "torch_dist": hf + fp8 + slack, "stage": 0}[step]
    half = {"fetch": hf, "fp8": fp8, "torch_dist": td, "stage": hf}[step] // 2
    disk = tmp_path / "disk"
    with _tmpfs(disk, before + half):
        models = tmp_path / "models" if step == "stage" else disk
        plan = _plan(models, source, disk / "stage" if step == "stage" else None)
        line = _one_error_line(_cli(plan))
        assert line.startswith(f"error: {step} of {MODEL}: no space left writing {disk}"), line
        assert "free of" in line and "nothing was marked done" in line and "free space there" in line
        _nothing_half_done(plan)
        _mount("-o", "remount,size=64m", str(disk))
        prepare(plan, progress=False)
        _same_as_reference(plan, ref, tree_digest)


def test_a_read_only_model_dir_is_one_line_and_a_finished_one_still_answers(reference, tmp_path, tree_digest):
    source, ref = reference
    writable, read_only = tmp_path / "models", tmp_path / "ro"
    writable.mkdir()
    read_only.mkdir()
    _mount("--bind", str(writable), str(read_only))
    try:
        _mount("-o", "remount,bind,ro", str(read_only))
        plan = _plan(read_only, source)
        line = _one_error_line(_cli(plan))
        assert f"of {MODEL} cannot run: read-only file system writing {read_only}" in line, line
        assert "remount it read-write" in line
        assert list(read_only.iterdir()) == []
        _mount("-o", "remount,bind,rw", str(read_only))
        prepare(plan, progress=False)
        _same_as_reference(plan, ref, tree_digest)
        # every step done: a read-only copy still answers, with nothing to write
        _mount("-o", "remount,bind,ro", str(read_only))
        again = _cli(plan)
        assert again.returncode == 0, again.stderr
        assert again.stdout.count("skipped") == len(STEPS)
    finally:
        subprocess.run(["umount", "-l", str(read_only)], check=False)


def _no_permission_override() -> None:
    """In the child, before exec: root loses the capabilities that bypass file permissions."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_model_dir_this_user_may_not_write_is_one_line_and_a_rerun_after_chmod_is_byte_identical(
    reference, tmp_path, tree_digest
):
    source, ref = reference
    models = tmp_path / "models"
    models.mkdir()
    models.chmod(0o555)
    plan = _plan(models, source)
    # as root the run gives up CAP_DAC_OVERRIDE, so the mode bits bind it as they bind any user
    demote = _no_permission_override if os.geteuid() == 0 else None
    try:
        first = _cli(plan, preexec=demote)
    except subprocess.SubprocessError as exc:
        pytest.skip(f"cannot drop CAP_DAC_OVERRIDE for the child ({exc}); run as a non-root user instead")
    line = _one_error_line(first)
    assert f"cannot run: permission denied writing {models}" in line, line
    assert "give this user write access" in line
    assert list(models.iterdir()) == []
    models.chmod(0o755)
    done = _cli(plan, preexec=demote)
    assert done.returncode == 0, done.stderr
    _same_as_reference(plan, ref, tree_digest)
