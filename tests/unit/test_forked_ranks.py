"""miles.train.forked_ranks, the CPU lanes' rank launcher: torchrun's environment and exit codes,
ranks forked after a shared import, the first failure ending the others, signals passed on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from miles.ci.register import register_cpu_ci
from miles.train.forked_ranks import trainer_preloads

register_cpu_ci(est_time=3, suite="stage-a-cpu")

LAUNCH = [sys.executable, "-m", "miles.train.forked_ranks"]

REPORT = """
import json, os, sys
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
line = json.dumps({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:], "name": __name__,
                   "pid": os.getpid(), "preloaded": "colorsys" in sys.modules})
os.write(1, (line + "\\n").encode())  # one write: the ranks share the pipe
"""


def _run(
    tmp_path: Path, body: str, *args: str, nproc: int = 2, timeout: float = 120
) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(body)
    cmd = [*LAUNCH, "--nproc-per-node", str(nproc), str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_each_rank_gets_torchruns_environment_and_the_arguments(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(REPORT)
    cmd = [*LAUNCH, "--nproc-per-node", "3", "--preload", "colorsys", str(script), "--flag", "-m", "x"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = sorted((json.loads(line) for line in done.stdout.splitlines()), key=lambda r: r["env"]["RANK"])
    assert [r["env"]["RANK"] for r in seen] == ["0", "1", "2"]
    assert all(r["env"]["LOCAL_RANK"] == r["env"]["RANK"] for r in seen)
    assert {r["env"]["WORLD_SIZE"] for r in seen} == {"3"} and {
        r["env"]["LOCAL_WORLD_SIZE"] for r in seen
    } == {"3"}
    assert {r["env"]["MASTER_ADDR"] for r in seen} == {"127.0.0.1"}
    assert len({r["env"]["MASTER_PORT"] for r in seen}) == 1 and int(seen[0]["env"]["MASTER_PORT"]) > 0
    assert all(r["argv"] == ["--flag", "-m", "x"] and r["name"] == "__main__" for r in seen)
    assert len({r["pid"] for r in seen}) == 3
    assert all(r["preloaded"] for r in seen)  # a --preload module is there before the program runs


def test_ranks_join_one_gloo_group(tmp_path):
    body = (
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([float(dist.get_rank() + 1)])\n"
        "dist.all_reduce(t)\n"
        "import os; os.write(1, f'{dist.get_rank()} {t.item()}\\n'.encode())\n"
        "dist.destroy_process_group()\n"
    )
    script = tmp_path / "worker.py"
    script.write_text(body)
    cmd = [*LAUNCH, "--nproc-per-node", "2", "--preload", "torch.distributed", str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split("\n")[:2]) == ["0 3.0", "1 3.0"]


def test_the_first_failing_rank_ends_the_others_with_its_exit_code(tmp_path):
    body = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(7)\ntime.sleep(600)\n"
    started = time.monotonic()
    done = _run(tmp_path, body)
    assert done.returncode == 7
    assert time.monotonic() - started < 300  # rank 0 was stopped, not waited for
    assert "rank 1" in done.stderr and "exited with 7" in done.stderr


def test_a_rank_killed_by_a_signal_fails_the_launch_with_128_plus_the_signal(tmp_path):
    body = "import os, signal\nif os.environ['RANK'] == '0':\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    assert _run(tmp_path, body).returncode == 128 + signal.SIGKILL


def test_an_exception_in_a_rank_prints_its_traceback_and_fails(tmp_path):
    done = _run(tmp_path, "raise RuntimeError('broken rank')\n")
    assert done.returncode == 1
    assert "RuntimeError: broken rank" in done.stderr


def test_sigterm_to_the_launcher_reaches_every_rank(tmp_path):
    marker = tmp_path / "marks"
    marker.mkdir()
    body = (
        "import os, signal, sys, time\n"
        f"def bye(*_):\n    open(os.path.join({str(marker)!r}, os.environ['RANK']), 'w').close()\n    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        f"open(os.path.join({str(marker)!r}, 'up' + os.environ['RANK']), 'w').close()\n"
        "time.sleep(600)\n"
    )
    script = tmp_path / "worker.py"
    script.write_text(body)
    proc = subprocess.Popen(
        [*LAUNCH, "--nproc-per-node", "2", str(script)], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while len(list(marker.glob("up*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    assert sorted(p.name for p in marker.iterdir()) == ["0", "1", "up0", "up1"]


def test_bad_command_lines_are_refused_with_the_fix(tmp_path):
    zero = subprocess.run(
        [*LAUNCH, "--nproc-per-node", "0", "-m", "json.tool"], capture_output=True, text=True
    )
    assert zero.returncode == 2 and "--nproc-per-node 0: give at least 1 rank" in zero.stderr
    missing = subprocess.run(
        [*LAUNCH, "--nproc-per-node", "1", str(tmp_path / "nope.py")], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "nope.py: no such script" in missing.stderr
    nothing = subprocess.run([*LAUNCH, "--nproc-per-node", "1"], capture_output=True, text=True)
    assert nothing.returncode == 2 and "no program" in nothing.stderr


def test_the_trainers_preload_follows_its_backend_and_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    fsdp = trainer_preloads(["--hf-checkpoint", str(tmp_path)])
    assert "transformers.models.qwen3.modeling_qwen3" in fsdp and "megatron.core.models.gpt" not in fsdp
    mg = trainer_preloads(["--train-backend", "megatron", f"--hf-checkpoint={tmp_path}"])
    assert "megatron.core.models.gpt" in mg and "miles.train.backends.megatron" in mg
    (tmp_path / "config.json").write_text('{"model_type": "../../etc"}')
    assert not any("etc" in m for m in trainer_preloads(["--hf-checkpoint", str(tmp_path)]))
