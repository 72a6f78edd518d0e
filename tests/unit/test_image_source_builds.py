"""The ROCm image's source builds against what their pinned sources say (miles/image/facts/).

No docker engine runs here: the Dockerfile's build steps and the stack's lock are read and held
to the facts each pinned source states, each fact citing where it was read. The ROCm image once
built the kernels from sglang's sgl-kernel/ (gone at 0.5.23), installed aiter's requirements
under a lock that pins four of them otherwise, lacked pybind11 for mori, chose
torch-memory-saver's HIP build with a variable its setup.py never reads, and left aiter
unpatched for the locked torch: each of these is named here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from miles.ci.register import register_cpu_ci
from miles.image.config import load_images
from miles.image.source_builds import load_facts, requirement, run_steps, source_build_problems

register_cpu_ci(est_time=1, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
# the build steps as they were (the image): sgl-kernel/, aiter's list under the lock, TMS_PLATFORM
OLD_STEPS = {
    "cd /opt/sglang/python/sglang/kernels/aot \\\n    && mv -f pyproject_rocm.toml pyproject.toml \\\n": (
        "cd /opt/sglang/sgl-kernel \\\n"
    ),
    "    && /opt/miles/apply-patches.sh /opt/miles/patches/rocm-aiter /opt/aiter \\\n": (
        '    && pip install --extra-index-url "${TORCH_INDEX}" -c /opt/miles/requirements.txt -r requirements.txt \\\n'
    ),
    "RUN export PATH=/opt/rocm/bin:${PATH} \\\n    && command -v hipcc \\\n    && pip install": "RUN TMS_PLATFORM=hip pip install",
}
# what the lock lacked then
OLD_LOCK_LACKS = ("pybind11", "flydsl", "matplotlib", "setuptools-scm", "cmake")


def test_the_rocm_images_source_builds_meet_what_their_pinned_sources_say():
    config = load_images()
    for variant in ("rocm720-mi35x", "rocm720-mi30x"):
        assert source_build_problems(ROOT, config.variant(variant)) == []


def _old_tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    (root / "docker").mkdir(parents=True)
    (root / "requirements").mkdir()
    text = (ROOT / "docker/Dockerfile.rocm").read_text()
    for new, old in OLD_STEPS.items():
        assert new in text
        text = text.replace(new, old)
    (root / "docker/Dockerfile.rocm").write_text(text)
    lock = [
        line
        for line in (ROOT / "requirements/rocm-mi350.txt").read_text().splitlines()
        if line.split("==")[0] not in OLD_LOCK_LACKS
    ]
    (root / "requirements/rocm-mi350.txt").write_text("\n".join(lock) + "\n")
    shutil.copytree(ROOT / "docker/patches", root / "docker/patches")
    return root


def test_the_old_build_steps_are_refused_each_with_its_reason(tmp_path):
    problems = source_build_problems(_old_tree(tmp_path), load_images().variant("rocm720-mi35x"))
    text = "\n".join(problems)
    assert "the kernels are built from sglang's python/sglang/kernels/aot" in text
    assert "does not put pyproject_rocm.toml in place of the tree's pyproject.toml" in text
    assert (
        "it installs ROCm/aiter's requirements.txt under the lock, which pins otherwise: pandas==3.0.3 (lock "
        "3.1.1), pytest==9.0.3 (lock 9.2.0), pyyaml==6.0.3 (lock 6.0.4), ninja==1.13.0 (lock 1.13.2) (pip stops "
        "with ResolutionImpossible)"
    ) in text
    assert (
        "(amd-mori @ 12d1bc32d0c9, miles/image/facts/mori-12d1bc32d0c9.toml): build_requires pybind11: the lock"
        in text
    )
    assert "passes csrc/cpp_itfs/torch_utils.py a plain torch.Stream it refuses" in text
    assert "the step sets TMS_PLATFORM, which its setup.py never reads" in text
    assert "builds for HIP only with hipcc on PATH" in text


def test_the_kernels_tree_is_the_one_the_installed_sglang_names():
    import importlib.metadata
    import importlib.util

    (facts,) = [f for (name, _), f in load_facts().items() if name == "sglang-kernel"]
    assert facts["pin"] == importlib.metadata.version("sglang")
    package = Path(
        importlib.util.find_spec("sglang").origin
    ).parent  # read, not imported (it needs a GPU stack)
    source = (package / "srt/mem_cache/pool_host/common.py").read_text()
    assert f"from {facts['source_tree']} ({facts['setup']})" in source


def test_every_fact_cites_where_it_was_read():
    facts = load_facts()
    assert {name for name, _ in facts} == {"sglang-kernel", "amd-aiter", "amd-mori", "torch-memory-saver"}
    for data in facts.values():
        cited = [data.get("source", ""), *data.get("sources", {}).values()]
        assert any("@" in c or "sglang 0.5.23" in c for c in cited), data["path"]
        for text in (*data.get("requirements", ()), *data.get("build_requires", ())):
            requirement(text)  # each parses


def test_run_steps_join_continuations_and_drop_comments(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM x\n# c\nRUN a \\\n    # inner\n    && b\nRUN c\n")
    assert run_steps(dockerfile) == ["a && b", "c"]
