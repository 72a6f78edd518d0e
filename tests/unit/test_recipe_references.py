"""The reference commands are re-read from the seed framework's launcher source, never typed in.

The real mirror of radixark/miles is not available here, so each test builds a small git
repository with the launcher's interfaces (its command_utils.execute_train submitting a Ray
job, model_args_utils, a model script and a launcher script) written for the test, commits it
on `main` (and one commit on a side branch), and reads it with the same code
`python -m miles.recipes references --check --mirror PATH` runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.recipes.fidelity import Reference
from miles.recipes.pysource import SourceError
from miles.recipes.reread import reread_one
from miles.recipes.upstream import Mirror, MirrorError, Upstream, read_launch

register_cpu_ci(est_time=3, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]

LAUNCHER = """
import json
import os
import shlex
from dataclasses import dataclass, field

from miles.utils.external_utils.exec_command import exec_command_cpu, exec_command_gpu
from miles.utils.external_utils.model_args_utils import shell_safe_model_args

repo_base_dir = "unused: modelled"
NUM_GPUS_OF_HARDWARE = {"H100": 8, "GB200": 4}


@dataclass
class ExecuteTrainConfig:
    num_nodes: int = field(default_factory=lambda: int(os.environ.get("SLURM_JOB_NUM_NODES", "1")))
    extra_env_vars: str = ""
    output_dir: str = "/root/shared_data"


def create_run_id():
    raise RuntimeError("modelled: never read")


def check_has_nvlink():
    output = exec_command_gpu("nvidia-smi topo -m | grep -c NV", capture_output=True)
    return int(output) > 0


def _parse(text):
    try:
        return json.loads(text)
    except ValueError:
        return {kv[0]: kv[1] for item in text.split(" ") if item.strip() if (kv := item.split("=")) or True}


def execute_train(train_args, num_gpus_per_node, megatron_model_type, extra_env_vars=None, config=None):
    exec_command_cpu("ray stop --force")
    env = {
        "PYTHONUNBUFFERED": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE") or str(int(check_has_nvlink())),
        "MASTER_ADDR": "127.0.0.1",
        **(extra_env_vars or {}),
        **_parse(config.extra_env_vars),
    }
    runtime = json.dumps({"env_vars": env})
    exec_command_cpu(
        f"ray job submit --runtime-env-json={shlex.quote(runtime)} -- python3 {repo_base_dir}/train.py "
        f"{shell_safe_model_args(megatron_model_type)} {train_args}"
    )
"""

MODEL_ARGS_UTILS = """
import shlex


def load_model_args(model_type, **kwargs):
    raise RuntimeError("modelled: never read")


def shell_safe_model_args(model_type):
    return " ".join(shlex.quote(t) for t in load_model_args(model_type).split())


def moe_layer_freq(*, nlayers, first_k_dense_replace):
    dense = min(first_k_dense_replace, nlayers)
    return "[" + ",".join(["0"] * dense + ["1"] * (nlayers - dense)) + "]"
"""

MODEL = """
import os

from model_args_utils import moe_layer_freq


def model_args(nlayers=None):
    nlayers = nlayers if nlayers is not None else int(os.environ.get("MODEL_ARGS_NUM_LAYERS") or 6)
    return (
        f"--num-layers {nlayers} "
        "--hidden-size 64 "
        f"--moe-layer-freq {moe_layer_freq(nlayers=nlayers, first_k_dense_replace=1)} "
    )
"""

SCRIPT = """
import os
from dataclasses import dataclass
from typing import Literal

import miles.utils.external_utils.command_utils as U


@dataclass
class ScriptArgs(U.ExecuteTrainConfig):
    run_id: str = U.create_run_id()
    hardware: Literal["H100", "GB200"] = "H100"
    num_gpus_per_node: int | None = None
    temperature: float = 1.0
    data_dir: str = "/root/datasets"

    def __post_init__(self):
        self.num_gpus_per_node = self.num_gpus_per_node or U.NUM_GPUS_OF_HARDWARE[self.hardware]

    @property
    def tp(self):
        return 2 if self.num_gpus_per_node >= 4 else 1


def execute(args: ScriptArgs):
    os.environ.setdefault("RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES", "1")
    rollout = f"--prompt-data {args.data_dir}/d.jsonl --rollout-temperature {args.temperature:g} "
    match (args.hardware, args.num_nodes):
        case ("H100", 1):
            perf = f"--tensor-model-parallel-size {args.tp} --sequence-parallel "
        case ("GB200" | "B200", _):
            perf = "--tensor-model-parallel-size 4 "
        case _:
            raise NotImplementedError
    misc = f"--actor-num-nodes {args.num_nodes} --actor-num-gpus-per-node {args.num_gpus_per_node} "
    if (extra := os.environ.get("EXTRA_FLAG")) is not None:
        misc += f"{extra} "
    U.execute_train(
        train_args=f"{rollout} {perf} {misc}",
        num_gpus_per_node=args.num_gpus_per_node,
        megatron_model_type="tiny-moe",
        extra_env_vars={"SGLANG_X": "1"},
        config=args,
    )
"""


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, check=True
    )
    return done.stdout.strip()


@pytest.fixture
def upstream(tmp_path: Path) -> tuple[Path, str, str]:
    """(repository, a commit on main, a commit only on a side branch)."""
    repo = tmp_path / "upstream"
    files = {
        "miles/utils/external_utils/command_utils.py": LAUNCHER,
        "miles/utils/external_utils/model_args_utils.py": MODEL_ARGS_UTILS,
        "scripts/models/tiny-moe.py": MODEL,
        "scripts/run_tiny.py": SCRIPT,
    }
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(textwrap.dedent(text).lstrip())
    _git(repo.parent, "init", "-q", "-b", "main", str(repo))
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "launcher")
    on_main = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-q", "-b", "side")
    script = repo / "scripts/run_tiny.py"
    script.write_text(script.read_text().replace("temperature: float = 1.0", "temperature: float = 0.7"))
    _git(repo, "commit", "-q", "-am", "side")
    side = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-q", "main")
    return repo, on_main, side


def _source(commit: str, **settings) -> Upstream:
    settings = {"data_dir": "{data_dir}", "run_id": "{run_id}", **settings}
    return Upstream("scripts/run_tiny.py", commit, "execute", tuple(settings.items()), "8 H100s", nvlink=True)


EXPECTED_ARGV = (
    "--num-layers", "6", "--hidden-size", "64", "--moe-layer-freq", "[0,1,1,1,1,1]",
    "--prompt-data", "{data_dir}/d.jsonl", "--rollout-temperature", "1",
    "--tensor-model-parallel-size", "2", "--sequence-parallel",
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8",
)  # fmt: skip
EXPECTED_ENV = (
    ("CUDA_DEVICE_MAX_CONNECTIONS", "1"), ("NCCL_NVLS_ENABLE", "1"), ("PYTHONUNBUFFERED", "1"),
    ("RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES", "1"), ("SGLANG_X", "1"),
)  # fmt: skip


def test_the_launcher_is_read_as_it_would_run(upstream):
    """Model flags first (the model script through model_args_utils), then the script's flags;
    the NVLink probe answers the reading's hardware; the Ray head's address is no recipe fact;
    what the script writes to os.environ reaches the job."""
    repo, on_main, _ = upstream
    launch = read_launch(Mirror(repo), _source(on_main))
    assert launch.argv == EXPECTED_ARGV
    assert launch.env == EXPECTED_ENV


def test_settings_and_the_environment_change_the_reading(upstream):
    repo, on_main, _ = upstream
    source = _source(on_main, hardware="GB200", temperature=0.8)
    source = Upstream(**{**source.__dict__, "environ": (("MODEL_ARGS_NUM_LAYERS", "2"),), "nvlink": False})
    launch = read_launch(Mirror(repo), source)
    assert launch.argv[:6] == ("--num-layers", "2", "--hidden-size", "64", "--moe-layer-freq", "[0,1]")
    assert ("--rollout-temperature", "0.8") == launch.argv[8:10]
    assert "--sequence-parallel" not in launch.argv and ("--actor-num-gpus-per-node", "4") == launch.argv[-2:]
    assert dict(launch.env)["NCCL_NVLS_ENABLE"] == "0"


def test_a_reading_the_script_refuses_is_an_error_naming_the_line(upstream):
    repo, on_main, _ = upstream
    with pytest.raises(
        SourceError, match=r"scripts/run_tiny.py:\d+: the script raises .*NotImplementedError"
    ):
        read_launch(Mirror(repo), _source(on_main, num_nodes=2))
    with pytest.raises(SourceError, match="ScriptArgs has no settable field"):
        read_launch(Mirror(repo), _source(on_main, no_such_flag=1))


def test_the_read_code_cannot_act_on_this_machine(upstream, tmp_path):
    """A launcher that would write a file or run a process is refused, not obeyed."""
    repo, _, _ = upstream
    marker = tmp_path / "written"
    script = repo / "scripts/run_tiny.py"
    script.write_text(
        script.read_text().replace(
            "    os.environ.setdefault(", f"    open({str(marker)!r}, 'w')\n    os.environ.setdefault("
        )
    )
    _git(repo, "commit", "-q", "-am", "hostile")
    with pytest.raises(SourceError, match="name 'open' is not defined in the read source"):
        read_launch(Mirror(repo), _source(_git(repo, "rev-parse", "HEAD")))
    assert not marker.exists()


def test_an_exact_quote_on_main_passes_the_check(upstream):
    repo, on_main, _ = upstream
    ref = Reference("cuda", "Tiny", _source(on_main), EXPECTED_ARGV, EXPECTED_ENV)
    finding = reread_one(Mirror(repo), "tiny", ref, "main")
    assert finding.ok, finding.lines()
    assert finding.lines()[0].startswith("ok   tiny cuda Tiny: radixark/miles scripts/run_tiny.py@")


def test_a_misquoted_value_fails_the_check_with_the_difference(upstream):
    repo, on_main, _ = upstream
    argv = tuple(
        "0.8" if t == "1" and EXPECTED_ARGV[i - 1] == "--rollout-temperature" else t
        for i, t in enumerate(EXPECTED_ARGV)
    )
    env = (*EXPECTED_ENV[:-1], ("SGLANG_X", "0"))
    finding = reread_one(Mirror(repo), "tiny", Reference("cuda", "Tiny", _source(on_main), argv, env), "main")
    assert not finding.ok
    assert "  ---rollout-temperature 0.8" in finding.problems
    assert "  +--rollout-temperature 1" in finding.problems
    assert "variable SGLANG_X: quoted '0', upstream '1'" in finding.problems


def test_a_commit_off_main_or_missing_fails_the_check(upstream):
    repo, on_main, side = upstream
    mirror = Mirror(repo)
    side_ref = Reference("cuda", "Tiny", _source(side), EXPECTED_ARGV, EXPECTED_ENV)
    finding = reread_one(mirror, "tiny", side_ref, "main")
    assert (
        f"commit {side[:12]} is not on main (an unmerged branch's commit is no reference)" in finding.problems
    )
    short = Reference("cuda", "Tiny", _source(on_main[:12]), EXPECTED_ARGV, EXPECTED_ENV)
    assert (
        f"cite the full commit {on_main}, not {on_main[:12]}"
        in reread_one(mirror, "tiny", short, "main").problems
    )
    gone = Reference("cuda", "Tiny", _source("f" * 40), EXPECTED_ARGV, EXPECTED_ENV)
    assert reread_one(mirror, "tiny", gone, "main").problems == (f"commit {'f' * 40} is not in {repo}",)


def test_the_check_command_fails_on_a_mirror_without_the_cited_commits(upstream):
    repo, _, _ = upstream
    proc = subprocess.run(
        [sys.executable, "-m", "miles.recipes", "references", "qwen3_4b", "--check", "--mirror", str(repo)],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("FAIL qwen3_4b cuda Qwen3-4B: radixark/miles scripts/run_qwen3_4b.py@")
    assert "is not in" in proc.stdout
    assert "reference reading(s) differ from" in proc.stderr


def test_the_check_command_needs_a_mirror(tmp_path):
    run = [sys.executable, "-m", "miles.recipes", "references", "--check"]
    proc = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and "need --mirror PATH" in proc.stderr
    proc = subprocess.run(
        [*run, "--mirror", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2 and "git rev-parse --git-dir" in proc.stderr
    with pytest.raises(MirrorError, match="no such directory"):
        Mirror(tmp_path / "absent")


def test_python_the_reader_does_not_support_is_refused_with_its_line():
    from miles.recipes.pysource import Evaluator, parse

    module = parse("scripts/x.py", "def f():\n    n = 0\n    while n < 3:\n        n += 1\n    return n\n")
    evaluator = Evaluator(lambda name: pytest.fail(f"nothing is imported here, not {name}"))
    with pytest.raises(SourceError, match=r"^scripts/x.py:3: While statements are not read$"):
        evaluator.call(evaluator.lookup(module, "f", module.tree), [], {})


def test_update_rewrites_the_quotes_and_keeps_the_configuration(upstream, tmp_path):
    from miles.recipes.references import read_file, write_launches

    repo, on_main, _ = upstream
    source = _source(on_main)
    reading = {
        "platform": "cuda", "model": "Tiny", "argv": ["--stale 1"], "env": {},
        "upstream": {"script": source.script, "commit": on_main, "entry": "execute", "settings": dict(source.settings),
                     "hardware": source.hardware, "nvlink": True},
    }  # fmt: skip
    file = tmp_path / "tiny.json"
    file.write_text(json.dumps({"format": 1, "recipe": "tiny", "readings": [reading]}))
    (stale,) = read_file(file)
    finding = reread_one(Mirror(repo), "tiny", stale, "main")
    assert not finding.ok
    write_launches(file, [finding.launch])
    (fresh,) = read_file(file)
    assert (fresh.argv, fresh.env, fresh.source) == (EXPECTED_ARGV, EXPECTED_ENV, stale.source)
    assert json.loads(file.read_text())["readings"][0]["argv"][:2] == ["--num-layers 6", "--hidden-size 64"]


def test_a_spec_citation_must_show_its_value_at_a_commit_on_main(upstream):
    from miles.recipes.reread import Citation, citation_problems, citations

    repo, on_main, side = upstream
    mirror = Mirror(repo)
    ok = Citation("Tiny", "hidden_size", 64, "scripts/models/tiny-moe.py", on_main[:8])
    assert citation_problems(mirror, ok) == []
    assert citation_problems(mirror, replace(ok, commit="044f7c8c")) == [
        f"Tiny hidden_size: radixark/miles scripts/models/tiny-moe.py@044f7c8c: commit 044f7c8c is not in {repo}"
    ]
    off = citation_problems(mirror, replace(ok, commit=side[:8]))
    assert off == [
        f"Tiny hidden_size: radixark/miles scripts/models/tiny-moe.py@{side[:8]}: commit {side[:12]} is not on main "
        "(an unmerged branch's commit is no source)"
    ]
    assert citation_problems(mirror, replace(ok, value=96))[0].endswith(f"at {on_main[:12]} does not say 96")
    assert citation_problems(mirror, replace(ok, path="scripts/models/gone.py"))[0].endswith(
        f"scripts/models/gone.py does not exist at {on_main[:12]}"
    )
    # every citation in the specs is read (the check cannot pass by finding none)
    assert {(c.spec, c.key) for c in citations()} >= {
        ("GLM-5.2-744B-A40B", "rope_theta"), ("DeepSeek-V4-Flash", "rope_scaling_factor"),
    }  # fmt: skip


def test_the_seed_images_variables_are_read_again_from_its_dockerfile(upstream, monkeypatch):
    from miles.recipes import references
    from miles.recipes.reread import image_env_problems

    repo, _, _ = upstream
    (repo / "docker").mkdir()
    (repo / "docker/Dockerfile.rocm").write_text(
        "ENV GPU_ARCH=gfx950\nENV SGLANG_MOE_PADDING=1\nENV HSA_X=1\n"
    )
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "image")
    commit = _git(repo, "rev-parse", "HEAD")
    quoted = {"repo": "radixark/miles", "path": "docker/Dockerfile.rocm", "commit": commit}
    monkeypatch.setattr(
        references, "rocm_image_env", lambda: {**quoted, "env": {"SGLANG_MOE_PADDING": "1", "HSA_X": "1"}}
    )
    assert image_env_problems(Mirror(repo)) == []
    monkeypatch.setattr(references, "rocm_image_env", lambda: {**quoted, "env": {"SGLANG_MOE_PADDING": "1"}})
    (problem,) = image_env_problems(Mirror(repo))
    assert "differ from the file's ENV lines: [('HSA_X', '1')]" in problem
