"""The device check's SGLang, bf16, MoE and two-GPU steps (run by scripts/gpu_check.sh).

`sglang` starts the pinned SGLang engine through miles' adapter on a tiny bf16 Qwen3, beside
the trainer's own model (the FSDP backend, --bf16), and prints one line per check:
`sglang-formats` (finish reasons and the logprob layout SGLang returns), `sglang-weights`
(the probe gap with synced weights, after the trainer moves, after a full weight-update
session), `sglang-memory` (three release/resume cycles, torch.cuda.mem_get_info after each:
the engine frees memory and takes no more back each time) and `sglang-logprob-gap` (SGLang
vs the trainer on the same sampled tokens in bf16: the number --ci-logprob-abs-diff-tol must
cover). `sglang-grpo` runs the tiny recipe with `--rollout-engine sglang --train-backend
megatron --bf16 --ci-test`; `megatron-moe` the Qwen3-MoE tiny recipe on the Megatron backend
(bf16 on a GPU); `multi-gpu` the tiny recipe on two GPUs over NCCL. The SGLang steps and
`multi-gpu` need a GPU (two) and are skipped, saying so, in the CPU form.
"""

from __future__ import annotations

import math
from pathlib import Path

from miles.ci.machine import device_check
from miles.ci.machine.device_check import CheckFailed, Skipped, import_problem, require, visible_gpus
from miles.ci.machine.device_check_train import train_tiny_recipe
from miles.megatron import CORE_MODULE
from miles.train.rollout import weights_for

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41], [70, 71, 72], [100, 101, 102, 103], [7], [200, 3, 9, 44]]
NEW_TOKENS = 16
BF16_TOL = 0.05  # --ci-logprob-abs-diff-tol of the bf16 runs; sglang-logprob-gap measures what it covers
GIB = 1 << 30
LEAK_SLACK = 256 << 20  # allocator granularity, not a leak


def sglang_ready(cpu: bool) -> None:
    if cpu:
        raise Skipped(
            "the SGLang engine needs a GPU (on CPU its adapter runs against sglang's own code in "
            "tests/unit/test_train_sglang_engine.py)"
        )
    if device_check.dry():
        raise Skipped(f"{device_check.dry_note()}: the SGLang engine needs a GPU to start")
    require("transformers", "safetensors")
    for module in ("sglang", "torch_memory_saver"):
        problem = import_problem(module)
        if problem:
            raise Skipped(f"needs {module}, which does not import here ({problem}); carry the lane's wheels")


def step_sglang(cpu: bool, workdir: Path) -> list:
    sglang_ready(cpu)
    from miles.ckpt.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("qwen3", 2, workdir / "qwen3", dtype="bfloat16")
    engine, backend = start(path)
    try:
        return [
            (name, *_checked(check, engine, backend))
            for name, check in (
                ("sglang-formats", check_formats),
                ("sglang-weights", check_weights),
                ("sglang-memory", check_memory),
                ("sglang-logprob-gap", check_logprob_gap),
            )
        ]
    finally:
        engine.close()


def _checked(check, engine, backend) -> tuple[str | None, str]:
    from miles.train.rollout import RolloutEngineError

    try:
        return None, check(engine, backend)
    except (CheckFailed, RolloutEngineError) as exc:
        return str(exc), ""


def start(path: Path):
    """The adapter's engine (one GPU) and the trainer's backend, both from `path`."""
    from miles.train.args import parse_config
    from miles.train.consumption import build
    from miles.train.distributed import DistInfo

    config = parse_config(
        ["--hf-checkpoint", str(path), "--rollout-engine", "sglang", "--bf16", "--sglang-mem-fraction-static", "0.3",
         "--update-weight-buffer-size", str(1 << 20)]  # several buckets even for a tiny model
    )  # fmt: skip
    info = DistInfo(rank=0, world_size=1, local_rank=0, device="cuda:0", backend="nccl")
    return build("engine", "sglang", config, info), build("backend", "fsdp", config, info)


def sampling(**changes):
    from miles.train.config import SamplingConfig

    return SamplingConfig(
        **{"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_response_len": NEW_TOKENS} | changes
    )


def check_formats(engine, backend) -> str:
    from miles.train.sglang_engine import sampling_params

    vocab = backend.model.config.vocab_size
    raw = engine.engine.generate(
        input_ids=PROMPTS, sampling_params=sampling_params(sampling(top_k=1), None), return_logprob=True
    )
    for out in raw:
        meta = out["meta_info"]
        finish, entries = meta["finish_reason"], meta["output_token_logprobs"]
        if not (isinstance(finish, dict) and finish.get("type") == "length" and len(entries) == NEW_TOKENS):
            raise CheckFailed(
                f"a greedy request of {NEW_TOKENS} tokens ended as {finish} with {len(entries)} logprobs"
            )
        for logprob, token, text in entries:
            if not (isinstance(logprob, float) and logprob <= 0 and 0 <= int(token) < vocab and text is None):
                raise CheckFailed(
                    f"output_token_logprobs entry ({logprob!r}, {token!r}, {text!r}) is not (logprob, id, None)"
                )
    stop = int(raw[0]["meta_info"]["output_token_logprobs"][1][1])
    (ended,) = engine.generate(PROMPTS[:1], sampling(top_k=1, stop_token_ids=(stop,)), seed=0)
    if ended.finish_reason != "stop" or ended.response_ids[-1] != stop:
        raise CheckFailed(
            f"stop token {stop} did not end the request: {ended.finish_reason}, {ended.response_ids}"
        )
    return (
        f"{len(raw)} greedy requests: finish_reason {raw[0]['meta_info']['finish_reason']}, output_token_logprobs "
        f"as (logprob, id, None) x {NEW_TOKENS}; a stop token ends a request after {len(ended.response_ids)} tokens"
    )


def check_weights(engine, backend) -> str:
    import torch

    from miles.train.checks import probe_logprob_gap

    synced = probe_logprob_gap(engine, backend, PROMPTS, sampling())
    with torch.no_grad():  # the trainer takes a step the engine is not told about
        for p in backend.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    stale = probe_logprob_gap(engine, backend, PROMPTS, sampling())
    engine.update_weights(weights_for(engine, backend))
    pushed = probe_logprob_gap(engine, backend, PROMPTS, sampling())
    summary = (
        f"probe gap {synced:.2g} synced, {stale:.2g} after the trainer moved, {pushed:.2g} after the session"
    )
    if not (pushed <= max(2 * synced, 1e-3) < stale):
        raise CheckFailed(
            f"{summary}: the weight-update session did not bring the engine to the trainer's weights"
        )
    return summary


def check_memory(engine, backend) -> str:
    import torch

    cycles = []
    for _ in range(3):
        torch.cuda.synchronize()
        held = torch.cuda.mem_get_info()[0]
        engine.release_memory()
        released = torch.cuda.mem_get_info()[0]
        engine.update_weights(weights_for(engine, backend))
        engine.generate(PROMPTS[:2], sampling(), seed=0)
        torch.cuda.synchronize()
        cycles.append((held, released, torch.cuda.mem_get_info()[0]))
    shown = "; ".join(f"free {h / GIB:.1f} -> {r / GIB:.1f} -> {b / GIB:.1f} GiB" for h, r, b in cycles)
    if any(r - h < GIB for h, r, _ in cycles):
        raise CheckFailed(f"releasing the engine's memory freed under 1 GiB: {shown}")
    if cycles[-1][2] < cycles[0][2] - LEAK_SLACK:
        raise CheckFailed(f"free memory shrinks with every release/resume cycle (a leak): {shown}")
    return f"3 release/resume cycles (free before -> released -> resumed): {shown}"


def check_logprob_gap(engine, backend) -> str:
    from miles.train.batch import Sample, collate

    generations = engine.generate(PROMPTS * 4, sampling(), seed=1)
    batch = collate([Sample(i, i, g, "", "", 0.0) for i, g in enumerate(generations)])
    gap = ((backend.logprobs(batch) - batch.rollout_logp).abs() * batch.loss_mask).flatten()
    tokens = int(batch.loss_mask.sum())
    mean, worst = float(gap.sum()) / tokens, float(gap.max())
    summary = f"SGLang vs the trainer (bf16) on the same {tokens} sampled tokens: mean |gap| {mean:.2g}, max {worst:.2g}"
    if not math.isfinite(mean) or mean > BF16_TOL:
        raise CheckFailed(f"{summary}, over the bf16 runs' --ci-logprob-abs-diff-tol {BF16_TOL}")
    return f"{summary}; --ci-logprob-abs-diff-tol must be above the mean"


def step_sglang_grpo(cpu: bool, workdir: Path) -> str:
    if cpu or not device_check.dry():  # the dry form checks the command, which needs no engine
        sglang_ready(cpu)
    require(CORE_MODULE)
    rollouts = 3
    series, elapsed = train_tiny_recipe(workdir, "sglang", (
        "--num-rollout", str(rollouts), "--rollout-engine", "sglang", "--train-backend", "megatron", "--bf16",
        "--ci-logprob-abs-diff-tol", str(BF16_TOL), "--sglang-mem-fraction-static", "0.3",
        "--rollout-max-response-len", "8", "--save-interval", str(rollouts), "--distributed-backend", "nccl",
        "--colocate",  # as the GPU recipes run it: the engine frees its memory while the trainer steps
    ))  # fmt: skip
    gap = max(series["train/train_rollout_logprob_abs_diff"].values())
    return (
        f"qwen3_4b tiny profile, --rollout-engine sglang --train-backend megatron --bf16 --colocate --ci-test, {rollouts} "
        f"rollouts in {elapsed:.0f}s: max train/train_rollout_logprob_abs_diff {gap:.2g}"
    )


def step_megatron_moe(cpu: bool, workdir: Path) -> str:
    rollouts = 2 if cpu else 4
    precision = () if cpu else ("--bf16", "--ci-logprob-abs-diff-tol", str(BF16_TOL))
    series, elapsed = train_tiny_recipe(workdir, "moe", (
        "--num-rollout", str(rollouts), "--expert-model-parallel-size", "1", "--rollout-engine", "torch",
        "--rollout-max-response-len", "4", "--save-interval", str(rollouts),
        "--distributed-backend", "gloo" if cpu else "nccl", *precision,
    ), recipe="qwen3_30b_a3b")  # fmt: skip
    gap = max(series["train/train_rollout_logprob_abs_diff"].values())
    return (
        f"qwen3_30b_a3b tiny profile (MoE) on --train-backend megatron{'' if cpu else ' --bf16'}, 1 rank, {rollouts} "
        f"rollouts with --ci-test in {elapsed:.0f}s: max train/train_rollout_logprob_abs_diff {gap:.2g}"
    )


def step_multi_gpu(cpu: bool, workdir: Path) -> str:
    if cpu:
        raise Skipped("needs two GPUs (the CPU lane trains on two gloo ranks in tests/e2e)")
    gpus = visible_gpus()
    if gpus < 2:
        faked = f" ({device_check.dry_note()})" if device_check.dry() else ""
        raise Skipped(f"needs two GPUs, {gpus} visible{faked}")
    require("transformers", "safetensors")
    rollouts = 4
    # rendered for FSDP (train_backend), so the tiny profile's Megatron layout flags are left out
    series, elapsed = train_tiny_recipe(workdir, "two-gpus", (
        "--num-rollout", str(rollouts), "--rollout-engine", "torch", "--bf16",
        "--ci-logprob-abs-diff-tol", str(BF16_TOL), "--save-interval", str(rollouts), "--distributed-backend", "nccl",
    ), ranks=2, train_backend="fsdp")  # fmt: skip
    gap = max(series["train/train_rollout_logprob_abs_diff"].values())
    return (
        f"qwen3_4b tiny profile on 2 GPUs over NCCL, FSDP --bf16, {rollouts} rollouts with --ci-test in "
        f"{elapsed:.0f}s: max train/train_rollout_logprob_abs_diff {gap:.2g}"
    )


STEPS = {
    "sglang": step_sglang,
    "sglang-grpo": step_sglang_grpo,
    "megatron-moe": step_megatron_moe,
    "multi-gpu": step_multi_gpu,
}
