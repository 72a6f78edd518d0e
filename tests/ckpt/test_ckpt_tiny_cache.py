"""Tiny checkpoints and their torch_dist forms are built once per cache and shared, verified on every use.

The cache (miles.ckpt.tiny_cache) addresses an entry by what it is made of: the same family, size
and build parameters are the same entry, built by make_tiny_checkpoint once however many callers
ask, also at the same moment from several processes; other parameters are another entry; a file
changed in place is noticed on the next use and the entry built again; the torch_dist form is
keyed by the checkpoint's content. The checkpoint pipeline takes a tiny source from the cache and
ends with the files it would have built. The CI runner gives every file of a run one fresh cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ckpt.manifest import read_manifest

register_cpu_ci(est_time=7, suite="stage-b-cpu")

# Counts the builder's calls in a file, around the one builder the cache calls.
COUNTING = """
import sys
import miles.ckpt.tiny_cache as cache
real = cache.make_tiny_checkpoint
def counted(*args, **kwargs):
    with open(sys.argv[2], "a") as f:
        f.write("built\\n")
    return real(*args, **kwargs)
cache.make_tiny_checkpoint = counted
entry = cache.tiny_checkpoint("qwen3", 1, root=sys.argv[1], hidden_size=32, intermediate_size=64)
print(entry.hf)
"""


def _ask(root: Path, counter: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", COUNTING, str(root), str(counter)], stdout=subprocess.PIPE, text=True
    )


def test_callers_in_several_processes_at_once_share_one_build(tmp_path):
    counter = tmp_path / "builds"
    procs = [_ask(tmp_path / "cache", counter) for _ in range(3)]
    paths = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1 and counter.read_text() == "built\n", (paths, counter.read_text())
    again = _ask(tmp_path / "cache", counter)
    assert again.communicate(timeout=300)[0].strip() in paths and counter.read_text() == "built\n"
    leftovers = [
        p.name for p in (tmp_path / "cache").iterdir() if ".partial-" in p.name or ".stale-" in p.name
    ]
    assert leftovers == []


def test_other_parameters_are_another_entry_and_the_same_are_the_same(tmp_path):
    from miles.ckpt.tiny_cache import tiny_checkpoint

    small = {"hidden_size": 32, "intermediate_size": 64}
    one = tiny_checkpoint("qwen3", 1, root=tmp_path, **small).hf
    assert tiny_checkpoint("qwen3", 1, root=tmp_path, **small).hf == one
    assert tiny_checkpoint("qwen3", 1, root=tmp_path, seed=1, **small).hf != one
    assert tiny_checkpoint("qwen3", 2, root=tmp_path, **small).hf != one
    assert json.loads((one / "config.json").read_text())["num_hidden_layers"] == 1


def test_a_file_changed_in_place_is_noticed_and_the_entry_built_again(tmp_path):
    from miles.ckpt.tiny_cache import tiny_checkpoint
    from miles.ckpt.verify import file_problems

    entry = tiny_checkpoint("qwen3", 1, root=tmp_path, hidden_size=32, intermediate_size=64).hf
    config = entry / "config.json"
    config.chmod(0o644)
    config.write_text(config.read_text().replace('"num_hidden_layers": 1', '"num_hidden_layers": 7'))
    again = tiny_checkpoint("qwen3", 1, root=tmp_path, hidden_size=32, intermediate_size=64).hf
    assert again == entry and json.loads(config.read_text())["num_hidden_layers"] == 1
    assert file_problems(entry, read_manifest(entry)) == []


def test_the_torch_dist_form_belongs_to_the_checkpoints_content(tmp_path):
    from miles.ckpt.tiny_cache import tiny_checkpoint
    from miles.ckpt.torch_dist import shape_problems

    first = tiny_checkpoint("qwen3", 1, torch_dist=True, root=tmp_path, hidden_size=32, intermediate_size=64)
    assert (
        tiny_checkpoint("qwen3", 1, torch_dist=True, root=tmp_path, hidden_size=32, intermediate_size=64)
        == first
    )
    assert shape_problems(first.torch_dist, first.hf) == []
    assert (first.torch_dist / "latest_checkpointed_iteration.txt").read_text() == "release"
    other = tiny_checkpoint(
        "qwen3", 1, torch_dist=True, root=tmp_path, seed=1, hidden_size=32, intermediate_size=64
    )
    assert other.torch_dist != first.torch_dist


def test_the_pipeline_copies_a_tiny_source_from_the_cache_and_ends_with_the_files_it_would_build(tmp_path):
    from miles.ckpt.pipeline import prepare
    from miles.ckpt.plan import CheckpointPlan

    def plan(model_dir: Path) -> CheckpointPlan:
        return CheckpointPlan(
            model_name="qwen3-1layer", family="qwen3", source="tiny:qwen3", model_dir=str(model_dir),
            steps=("fetch", "validate", "torch_dist"), num_layers=1,
        )  # fmt: skip

    built = prepare(plan(tmp_path / "built"), progress=False)
    cached = prepare(plan(tmp_path / "cached"), progress=False, tiny_cache=tmp_path / "cache")
    steps = {s.step: s for s in cached.steps}
    assert "from the cache" in steps["fetch"].detail and steps["torch_dist"].status == "ran", cached.table()
    for name in ("qwen3-1layer", "qwen3-1layer_torch_dist"):
        made, copied = read_manifest(tmp_path / "built" / name), read_manifest(tmp_path / "cached" / name)
        assert copied is not None and copied.files == made.files, name
    assert os.access(tmp_path / "cached" / "qwen3-1layer" / "config.json", os.W_OK)  # the plan's own copy
    assert {s.status for s in prepare(plan(tmp_path / "cached"), progress=False).steps} == {"skipped"}
    assert {s.status for s in built.steps} == {"ran"}


def test_a_missing_cache_is_a_clear_error(monkeypatch):
    from miles.ckpt.errors import CheckpointError
    from miles.ckpt.tiny_cache import CACHE_ENV, tiny_checkpoint

    monkeypatch.delenv(CACHE_ENV, raising=False)
    with pytest.raises(CheckpointError, match=CACHE_ENV):
        tiny_checkpoint("qwen3", 1)
