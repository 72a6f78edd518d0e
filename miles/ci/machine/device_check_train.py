"""The device check's training steps (run by scripts/gpu_check.sh): `grpo` (the qwen3_4b recipe's
tiny profile on one rank with --ci-test, 16 rollouts that must learn, FSDP), `megatron-parity`
(HF logits against the megatron GPTModel loaded from the torch_dist conversion, Qwen3 and
Qwen3-MoE, fp32) and `megatron-grpo` (the same tiny profile on the Megatron backend, learning
synthetic:echo), and `train_tiny_recipe`, which every training step of the check runs through:
in the dry form it renders the GPU form's command and puts it through the trainer's start
checks instead of running it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from miles.ci.machine import device_check
from miles.ci.machine.device_check import PARITY_TOL, CheckFailed, Skipped, device_of, require
from miles.megatron import CORE_MODULE

TRAIN_TIMEOUT_S = 600  # for a hung run, not a slow one: the CPU check's runs end in seconds


def train_tiny_recipe(
    workdir: Path,
    run_id: str,
    args: tuple[str, ...],
    *,
    recipe: str = "qwen3_4b",
    ranks: int = 1,
    train_backend: str | None = None,
) -> tuple[dict, float]:
    """A recipe's tiny profile with `args` on `ranks` ranks (rendered for `train_backend` when
    given, so no flag of another backend's layout is passed); its metric series and seconds."""
    from miles.ckpt.pipeline import prepare
    from miles.ckpt.tiny_cache import CACHE_ENV
    from miles.load import run_counted
    from miles.metrics.capture import RECORD_DIR_ENV, decode_value
    from miles.recipes import load
    from miles.recipes.launch import RunOptions, build_plan

    options = RunOptions(
        model="tiny", model_dir=str(workdir / "models"), output_dir=str(workdir / "runs"), run_id=run_id,
        python=sys.executable, extra_args=(*args, "--tensor-model-parallel-size", "1", "--actor-num-gpus-per-node", str(ranks)),
    )  # fmt: skip
    form = load(recipe, platform="cpu")
    plan = build_plan(form.on_backend(train_backend) if train_backend else form, options, "cpu", base_env={})
    if "torch_dist" in plan.checkpoint.steps:  # the conversion imports megatron-core: say so first
        require(CORE_MODULE)
    if device_check.dry():
        checked = start_checks(plan.train_args, ranks)
        raise Skipped(f"{device_check.dry_note()}: needs {ranks} GPU(s) to run; {checked}")
    prepare(plan.checkpoint, progress=False, tiny_cache=os.environ.get(CACHE_ENV) or None)
    record = workdir / f"record-{run_id}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "miles.train", *plan.train_args]  # fmt: skip
    started = time.perf_counter()
    try:  # counted at the machine's load: a busy CPU machine makes the run slow, not hung
        done = run_counted(command, TRAIN_TIMEOUT_S, env={**os.environ, RECORD_DIR_ENV: str(record)})
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        last = stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise CheckFailed(
            f"the tiny recipe ({run_id}) had not ended after {e.timeout:.0f}s ({TRAIN_TIMEOUT_S}s at the "
            f"machine's load), last line: {last[0]}; either "
            "the trainer hung or a process it started still holds its output open: look for leftover "
            "`miles.train` or multiprocessing processes (`ps -ef`) and stop them before a rerun"
        ) from None
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        tail = [
            line for line in done.stderr.splitlines() if line.startswith("miles.train:")
        ] or done.stderr.splitlines()
        raise CheckFailed(f"the tiny recipe exited {done.returncode}: {' | '.join(tail[-3:])}")
    series = {}
    for path in record.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            series[row["metric"]] = {int(s): decode_value(v) for s, v in row["series"]}
    return series, elapsed


def start_checks(train_args: tuple[str, ...], ranks: int) -> str:
    """The trainer's own start checks of a command at `ranks` ranks, run without a device: the
    flags against the world size and against what the run's components consume
    (miles.train.runtime.check_flags), and a Megatron command's options against the GPU
    platform (miles.megatron.options, as rendering checks a recipe); CheckFailed names what
    they refuse."""
    from miles.megatron.options import render_problems
    from miles.recipes.stack import stack_has_te
    from miles.train.args import ArgsError, parse_config
    from miles.train.runtime import check_flags

    platform = "rocm" if os.environ.get("MILES_HARDWARE_PLATFORM") == "rocm" else "cuda"
    try:
        config = parse_config(list(train_args))
        engine = "sglang" if config.job.rollout_engine == "auto" else config.job.rollout_engine
        check_flags(config, ranks, engine)
    except (ArgsError, SystemExit) as exc:
        raise CheckFailed(f"the trainer refuses the command at {ranks} rank(s): {exc}") from None
    if config.job.train_backend == "megatron":
        problems = render_problems(train_args, platform, stack_has_te(platform))
        if problems:
            shown = "; ".join(f"{flag}: {why}" for flag, why in problems)
            raise CheckFailed(f"the Megatron backend refuses the command on {platform}: {shown}")
    return (
        f"its command (--train-backend {config.job.train_backend}, --rollout-engine {engine}, {ranks} rank(s)) "
        "passes the trainer's start checks"
    )


def step_grpo(cpu: bool, workdir: Path) -> str:
    rollouts = 2 if cpu else 16
    series, elapsed = train_tiny_recipe(
        workdir,
        "grpo",
        (
            "--num-rollout",
            str(rollouts),
            "--n-samples-per-prompt",
            "8",
            "--rollout-max-response-len",
            "6",
            "--micro-batch-size",
            "8",
            "--lr",
            "5e-3",
            "--weight-decay",
            "0",
            "--save-interval",
            str(rollouts),
            "--rollout-engine",
            "torch",
            "--distributed-backend",
            "gloo" if cpu else "nccl",
        ),
        train_backend="fsdp",
    )  # fmt: skip  (the recipe's tiny profile is Megatron; this step is the FSDP backend's)
    reward = series["rollout/raw_reward"]
    gap = max(series["train/train_rollout_logprob_abs_diff"].values())
    first, last = (
        sum(reward[s] for s in steps) / len(steps) for steps in (range(2), range(rollouts - 2, rollouts))
    )
    summary = (
        f"qwen3_4b tiny profile, 1 rank over {'gloo' if cpu else 'NCCL'}, {rollouts} rollouts with --ci-test in "
        f"{elapsed:.0f}s: reward {first:.2f} -> {last:.2f}, max train/train_rollout_logprob_abs_diff {gap:.1e}"
    )
    if not cpu and last - first <= 0.3:
        raise CheckFailed(f"{summary}: no learning (the CPU lane's run gains more than 0.3)")
    return summary


def _placed(cpu: bool):
    """megatron-core's CPU redirects around CPU work; a GPU run uses megatron-core as it is."""
    import contextlib

    from miles.megatron.compat import cpu_placed

    return cpu_placed() if cpu else contextlib.nullcontext()


def step_megatron_parity(cpu: bool, workdir: Path) -> str:
    """HF logits against the megatron GPTModel loaded from the torch_dist conversion, fp32."""
    import torch

    from miles.ckpt.tiny_cache import tiny_here
    from miles.ckpt.torch_dist import RELEASE
    from miles.families.model import hf_logit_gap, load_model
    from miles.megatron.checkpoint import single_process_group

    device = device_of(cpu)
    torch.backends.cuda.matmul.allow_tf32 = False
    tol = PARITY_TOL["cpu" if cpu else "gpu"]
    gaps = {}
    for family in ("qwen3", "qwen3_moe"):
        made = tiny_here(family, 2, workdir / family / "hf", torch_dist=True)
        hf, dist = made.hf, made.torch_dist
        config = json.loads((hf / "config.json").read_text())
        with single_process_group(), torch.random.fork_rng(devices=[]), _placed(cpu):
            model = load_model(config, dist / RELEASE, dtype=torch.float32, on_cpu=cpu)
            gaps[family] = hf_logit_gap(hf, model.to(device), config, device)
    report = ", ".join(f"{f} {g:.1e}" for f, g in gaps.items())
    if max(gaps.values()) > tol:
        raise CheckFailed(f"HF vs Megatron max |logit gap| over {tol:g}: {report}")
    return f"HF vs Megatron GPTModel from the torch_dist conversion, max |logit gap| (fp32, tol {tol:g}): {report}"


def step_megatron_grpo(cpu: bool, workdir: Path) -> str:
    """The tiny Qwen3 recipe with the Megatron backend on one rank, learning the echo task."""
    rollouts = 2 if cpu else 40
    series, elapsed = train_tiny_recipe(workdir, "megatron", (
        "--num-rollout", str(rollouts), "--prompt-data", "synthetic:echo", "--rollout-max-response-len", "1",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "32", "--global-batch-size", "64",
        "--micro-batch-size", "32", "--rollout-temperature", "1", "--lr", "3e-3", "--save-interval", str(rollouts),
        "--rollout-engine", "torch", "--distributed-backend", "gloo" if cpu else "nccl",
    ))  # fmt: skip
    exact = series["rollout/exact_match"]
    gap = max(series["train/train_rollout_logprob_abs_diff"].values())
    window = min(8, rollouts)
    first = sum(exact[s] for s in range(min(4, rollouts))) / min(4, rollouts)
    last = sum(exact[s] for s in range(rollouts - window, rollouts)) / window
    summary = (
        f"qwen3_4b tiny profile on --train-backend megatron, 1 rank over {'gloo' if cpu else 'NCCL'}, {rollouts} "
        f"rollouts of synthetic:echo with --ci-test in {elapsed:.0f}s: exact match {first:.2f} -> {last:.2f}, "
        f"max train/train_rollout_logprob_abs_diff {gap:.1e}"
    )
    if not cpu and last < 0.5:
        raise CheckFailed(
            f"{summary}: the policy did not learn to read its prompt (the CPU lane's runs reach 0.7)"
        )
    return summary


STEPS = {
    "grpo": step_grpo,
    "megatron-parity": step_megatron_parity,
    "megatron-grpo": step_megatron_grpo,
}
