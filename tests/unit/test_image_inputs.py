"""The image input hash, the dated tag and the refresh-image plan."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.machine.stacks import image_config, stack_for_lane
from miles.ci.register import register_cpu_ci
from miles.image.config import load_images
from miles.image.inputs import InputsError, image_tag, input_hash, parse_tag, variant_inputs
from miles.image.plan import plan_refresh

register_cpu_ci(est_time=1, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
DAY = dt.date(2026, 3, 9)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of every file any variant reads, plus an unrelated file, in a fresh root."""
    config = load_images()
    for variant in config.variants.values():
        for rel in variant_inputs(ROOT, variant, config):
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, tmp_path / rel)
    shutil.copy2(ROOT / "requirements" / "cpu.txt", tmp_path / "requirements" / "cpu.txt")
    (tmp_path / "README.md").write_text("# unrelated\n")
    return tmp_path


def _hash(root: Path, variant: str = "rocm720-mi35x") -> str:
    config = load_images()
    return input_hash(root, config.variant(variant), config).digest


def test_hash_is_stable_across_copies_of_the_same_inputs(project):
    assert _hash(project) == _hash(ROOT)


def test_changing_a_pin_changes_the_hash(project):
    lock = project / "requirements" / "rocm-mi350.txt"
    before = _hash(project)
    lock.write_text(lock.read_text().replace("numba==0.65.1", "numba==0.65.0"))
    assert _hash(project) != before


def test_unrelated_files_leave_the_hash_alone(project):
    before = _hash(project)
    (project / "README.md").write_text("# edited\n")
    cpu_lock = project / "requirements" / "cpu.txt"
    cpu_lock.write_text(cpu_lock.read_text() + "extra-package==1.0\n")
    assert _hash(project) == before


def test_adding_a_patch_changes_only_the_variants_that_apply_patches(project):
    rocm, cuda = _hash(project, "rocm720-mi35x"), _hash(project, "cu13")
    (project / "docker" / "patches" / "rocm" / "0001-fix.patch").write_text("--- a/x\n+++ b/x\n")
    assert _hash(project, "rocm720-mi35x") != rocm
    assert _hash(project, "cu13") == cuda


def test_the_two_rocm_variants_differ_by_their_settings():
    assert _hash(ROOT, "rocm720-mi35x") != _hash(ROOT, "rocm720-mi30x")


def test_a_missing_input_is_named(project):
    (project / "docker" / "Dockerfile.rocm").unlink()
    with pytest.raises(InputsError, match=r"rocm720-mi35x.*docker/Dockerfile.rocm"):
        _hash(project)


def test_tag_is_dated_and_content_addressed():
    tag = image_tag("ghcr.io/x/miles", "rocm720-mi35x", DAY, "135e56c2" + "0" * 56)
    assert tag == "ghcr.io/x/miles:rocm720-mi35x-20260309-135e56c2"
    parsed = parse_tag(tag)
    assert (parsed.variant, parsed.date, parsed.hash8) == ("rocm720-mi35x", "20260309", "135e56c2")


def test_an_undated_tag_is_refused():
    with pytest.raises(ValueError, match="<variant>-<YYYYMMDD>-<hash8>"):
        parse_tag("ghcr.io/x/miles:rocm720-mi35x")


def test_dry_plan_prints_the_complete_buildx_command():
    plan = plan_refresh(ROOT, "rocm720-mi35x", image="ghcr.io/x/miles", today=DAY, config=image_config())
    digest = _hash(ROOT)
    assert plan.tag == f"ghcr.io/x/miles:rocm720-mi35x-20260309-{digest[:8]}"
    command = " ".join(plan.build)
    for part in (
        "docker buildx build",
        "--file .miles/image-context/rocm720-mi35x/docker/Dockerfile.rocm",
        "--platform linux/amd64",
        "--build-arg STACK=rocm-mi350",
        "--build-arg PYTHON_VERSION=3.12",
        "--build-arg TORCH_INDEX=https://download.pytorch.org/whl/rocm7.2",
        "--build-arg GPU_ARCHS=gfx950",
        f"--label dev.miles.inputs-hash={digest}",
        f"--tag {plan.tag}",
        "--load",
    ):
        assert part in command
    assert command.endswith(" .miles/image-context/rocm720-mi35x")
    assert plan.alias not in plan.build  # the alias moves only with --push
    assert plan.render().count("\n") > 8


def test_push_adds_the_rolling_alias_beside_the_dated_tag():
    plan = plan_refresh(ROOT, "cu13", image="ghcr.io/x/miles", push=True, today=DAY, config=image_config())
    tags = [plan.build[i + 1] for i, arg in enumerate(plan.build) if arg == "--tag"]
    assert tags == [plan.tag, "ghcr.io/x/miles:cu13"]
    assert "--push" in plan.build


def test_every_lane_has_a_stack_of_its_backend():
    assert stack_for_lane("nightly-mi350-8gpu").name == "rocm-mi350"
    assert stack_for_lane("cuda-h200").python == "3.12"
    assert stack_for_lane("cpu").python == "3.11"


def test_images_toml_is_checked_against_the_lanes_the_ci_passes_in(tmp_path):
    from miles.image.config import ImageConfigError, LaneFacts

    assert image_config().lanes_of_stack("rocm-mi350") == (
        "rocm-mi350", "nightly-mi350-2gpu", "nightly-mi350-4gpu", "nightly-mi350-8gpu",
    )  # fmt: skip
    lanes = (LaneFacts("cpu", "cpu", "3.11"), LaneFacts("cuda-h200", "cuda", "3.12"))
    with pytest.raises(
        ImageConfigError, match=r"\[stacks.rocm-mi350\]: no catalog lane is called 'rocm-mi350'"
    ):
        load_images(lanes=lanes)
    # read alone, a stack has no Python and nothing of miles.ci is imported
    code = (
        "import sys; from miles.image.config import load_images; import miles.image.plan, miles.image.te, "
        "miles.image.lock; s = load_images().stack('cpu'); "
        "assert s.python is None and not [m for m in sys.modules if m.startswith('miles.ci')], sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
