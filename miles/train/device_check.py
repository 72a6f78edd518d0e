"""The steps of the one-GPU device check (`scripts/gpu_check.sh` runs them in order).

    python -m miles.train.device_check STEP [--cpu] [--workdir DIR]

Steps: `platform` (what the machine and the stack are), `parity` (the rollout engine's
per-token logprobs against one full forward, every recipe family, fp32), `generate` (the
rollout engine's greedy decoding against transformers' generate() on a ~0.2B random Qwen3 in
bf16), `grpo` (the qwen3_4b recipe's tiny profile on one rank over NCCL with --ci-test,
16 rollouts that must learn, FSDP), `megatron-parity` (HF logits against the megatron GPTModel
loaded from the torch_dist conversion, Qwen3 and Qwen3-MoE, fp32), `megatron-grpo` (the same
tiny profile on the Megatron backend, learning synthetic:echo), and the steps of
miles.train.device_check_sglang: the SGLang engine (formats, a weight-update session, memory
release cycles, its logprob gap to the trainer), a bf16 Megatron run with SGLang rollouts, a
bf16 MoE run, and two GPUs. Each prints `PASS <step>: ...`, `FAIL <step>: ...` or `SKIP
<step>: <why>` (a package it needs is missing, or it needs a GPU or a second one) and exits 1
only on a failure. `--cpu` runs the same code on CPU at CI size (gloo, fewer rollouts, a
smaller model), which is how CI keeps this script working between GPU runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from miles.families import names as family_names
from miles.megatron import CORE_MODULE

# Distinct lengths (left padding), a GRPO group sharing its prefill, a one-token prompt.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40], [70, 71, 72]] + [[100, 101, 102, 103]] * 4
PARITY_TOL = {"cpu": 1e-5, "gpu": 1e-4}  # fp32; GPU kernels sum in other orders than a full forward
NEAR_TIE = 0.05  # bf16: two tokens whose logprobs differ by less are a tie either side may break


class CheckFailed(RuntimeError):
    pass


class Skipped(RuntimeError):
    """The step cannot run here; the message says why (a missing package, no GPU)."""


# What each step imports beyond torch (a bare machine has only torch; the rest comes as wheels).
NEEDS = {
    "parity": ("transformers", "safetensors"),
    "generate": ("transformers",),
    "grpo": ("transformers", "safetensors"),
    "megatron-parity": ("transformers", "safetensors", CORE_MODULE),
    "megatron-grpo": ("transformers", "safetensors", CORE_MODULE),
    "megatron-moe": ("transformers", "safetensors", CORE_MODULE),
}


def import_problem(module: str) -> str | None:
    """Why `module` does not import here (in a process of its own: importing sglang patches
    transformers), or None."""
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300
    )
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {done.returncode}"


def require(*modules: str) -> None:
    """Skip the step when a module it needs is not installed."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        raise Skipped(
            f"needs {', '.join(missing)}, not installed (carry the wheels: MILES_WHEELS in scripts/gpu_check.sh)"
        )


def device_of(cpu: bool) -> str:
    import torch

    if cpu:
        return "cpu"
    if not torch.cuda.is_available():
        raise CheckFailed(f"no GPU visible to torch {torch.__version__}; run with --cpu for the CPU form")
    return "cuda:0"


def step_platform(cpu: bool, workdir: Path) -> str:
    import torch

    from miles.platform import resolve

    info = resolve()
    if not cpu and info.platform == "cpu":
        raise CheckFailed(f"expected a GPU, found {info.describe()}")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    try:
        import transformers
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from miles.train.rollout import cache_keyword

        with torch.device("meta"):
            keyword = cache_keyword(Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=1)))
        stack = f"transformers {transformers.__version__} (KV cache passed as '{keyword}')"
    except ImportError as exc:
        stack = f"transformers no ({exc})"
    # imported for real, each in its own process: a package that is installed but cannot load
    # (sglang without triton) is a "no"
    found = {
        m: import_problem(m) for m in ("sglang", "torch_memory_saver", "transformer_engine", CORE_MODULE)
    }
    return f"{info.describe()}; device {gpu}; torch {torch.__version__}; {stack}; " + ", ".join(
        f"{m} {'yes' if problem is None else f'no ({problem})'}" for m, problem in found.items()
    )


def _full_forward_gap(model, generations, temperature: float) -> float:
    import torch

    worst = 0.0
    device = next(model.parameters()).device
    for g in generations:
        ids = torch.tensor([list(g.prompt_ids) + list(g.response_ids)], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        start = len(g.prompt_ids) - 1
        rows = torch.arange(start, start + len(g.response_ids), device=device)
        expected = logp[rows, torch.tensor(g.response_ids, device=device)]
        worst = max(worst, (torch.tensor(g.logprobs) - expected.cpu()).abs().max().item())
    return worst


def step_parity(cpu: bool, workdir: Path) -> str:
    import torch

    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.train.config import SamplingConfig
    from miles.train.model import load_causal_lm
    from miles.train.rollout import TorchRolloutEngine

    device = device_of(cpu)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
    torch.backends.cudnn.allow_tf32 = False
    tol = PARITY_TOL["cpu" if cpu else "gpu"]
    gaps = {}
    for family in family_names():
        path = make_tiny_checkpoint(family, 2, workdir / "tiny" / family, dtype="float32")
        model = load_causal_lm(path, dtype=torch.float32, device=device)
        sampling = SamplingConfig(temperature=0.9, top_p=1.0, top_k=-1, max_response_len=8)
        generations = TorchRolloutEngine(model).generate(PROMPTS, sampling, seed=7)
        gaps[family] = _full_forward_gap(model, generations, 0.9)
    report = ", ".join(f"{f} {g:.1e}" for f, g in gaps.items())
    if max(gaps.values()) > tol:
        raise CheckFailed(f"engine vs full forward max |logprob gap| over {tol:g}: {report}")
    return f"engine vs full forward, max |logprob gap| (fp32, tol {tol:g}): {report}"


def qwen3_model(cpu: bool):
    """A random Qwen3: ~0.2B parameters on GPU, a few million on CPU (same code)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dims = (
        dict(
            hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, vocab_size=512
        )
        if cpu
        else dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=8,
            num_attention_heads=16,
            vocab_size=32768,
        )
    )
    config = Qwen3Config(
        **dims, num_key_value_heads=dims["num_attention_heads"] // 2, head_dim=64, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.1,  # wider than 0.02: fewer near-ties to break
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(device_of(cpu), dtype=torch.bfloat16).eval(), config


def step_generate(cpu: bool, workdir: Path) -> str:
    import torch

    from miles.train.config import SamplingConfig
    from miles.train.rollout import TorchRolloutEngine

    model, config = qwen3_model(cpu)
    device = next(model.parameters()).device
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, config.vocab_size, (n,), generator=g).tolist()
        for n in (8, 13, 21, 32, 5, 17, 26, 11)
    ]
    new = 8 if cpu else 32
    started = time.perf_counter()
    ours = TorchRolloutEngine(model).generate(prompts, SamplingConfig(1.0, 1.0, 1, new), seed=0)
    ours_s = time.perf_counter() - started
    started = time.perf_counter()
    theirs = []
    for p in prompts:
        out = model.generate(
            torch.tensor([p], device=device), max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
        theirs.append(out[0, len(p) :].tolist())
    hf_s = time.perf_counter() - started
    agree, unexplained = 0, []
    for p, gen, ref in zip(prompts, ours, theirs, strict=True):
        mine = list(gen.response_ids)
        k = next((i for i, (a, b) in enumerate(zip(mine, ref, strict=True)) if a != b), len(ref))
        agree += k
        if k < len(ref):
            # A divergence is fine only at a near-tie: both tokens about equally likely there.
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([p + mine[:k]], device=device)).logits[0, -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            gap = (logp[mine[k]] - logp[ref[k]]).abs().item()
            if gap > NEAR_TIE:
                unexplained.append(
                    f"prompt of {len(p)} tokens, step {k}: {mine[k]} vs {ref[k]} (gap {gap:.3f})"
                )
    total = len(prompts) * new
    summary = (
        f"{params / 1e6:.0f}M-parameter Qwen3 in bf16, {len(prompts)} prompts x {new} greedy tokens: "
        f"{agree}/{total} tokens equal to generate() before any near-tie; engine {ours_s:.2f}s "
        f"(batched) vs generate() {hf_s:.2f}s (one prompt at a time)"
    )
    if unexplained:
        raise CheckFailed(f"{summary}; divergences that are not near-ties: {'; '.join(unexplained)}")
    return summary


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
    from miles.metrics.capture import RECORD_DIR_ENV, decode_value
    from miles.recipes import load
    from miles.recipes.launch import RunOptions, build_plan

    options = RunOptions(
        model="tiny", model_dir=str(workdir / "models"), output_dir=str(workdir / "runs"), run_id=run_id,
        python=sys.executable, extra_args=(*args, "--tensor-model-parallel-size", "1", "--actor-num-gpus-per-node", str(ranks)),
    )  # fmt: skip
    form = load(recipe, platform="cpu")
    plan = build_plan(form.on_backend(train_backend) if train_backend else form, options, "cpu", base_env={})
    prepare(plan.checkpoint, progress=False)
    record = workdir / f"record-{run_id}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "miles.train", *plan.train_args]  # fmt: skip
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, env={**os.environ, RECORD_DIR_ENV: str(record)}, capture_output=True, text=True,
            timeout=TRAIN_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        # TimeoutExpired carries bytes even with text=True
        last = (e.stderr or b"").decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise CheckFailed(
            f"the tiny recipe ({run_id}) had not ended after {TRAIN_TIMEOUT_S}s, last line: {last[0]}; either "
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

    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.ckpt.torch_dist import RELEASE, convert_to_torch_dist
    from miles.families.model import hf_logit_gap, load_model
    from miles.megatron.checkpoint import single_process_group

    device = device_of(cpu)
    torch.backends.cuda.matmul.allow_tf32 = False
    tol = PARITY_TOL["cpu" if cpu else "gpu"]
    gaps = {}
    for family in ("qwen3", "qwen3_moe"):
        hf = make_tiny_checkpoint(family, 2, workdir / family / "hf")
        dist = workdir / family / "torch_dist"
        if not dist.exists():
            dist.mkdir(parents=True)
            convert_to_torch_dist(hf, dist, family)
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


def _steps() -> dict:
    from miles.train import device_check_sglang as more

    return {
        "platform": step_platform,
        "parity": step_parity,
        "generate": step_generate,
        "grpo": step_grpo,
        "megatron-parity": step_megatron_parity,
        "megatron-grpo": step_megatron_grpo,
        **more.STEPS,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m miles.train.device_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("step", choices=list(_steps()))
    parser.add_argument("--cpu", action="store_true", help="the same step on CPU at CI size")
    parser.add_argument("--workdir", type=Path, default=Path(".miles/device-check"))
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        require(*NEEDS.get(args.step, ()))
        detail = _steps()[args.step](args.cpu, args.workdir)
    except Skipped as exc:
        print(f"SKIP {args.step}: {exc}", flush=True)
        return 0
    except CheckFailed as exc:
        print(f"FAIL {args.step} ({time.perf_counter() - started:.0f}s): {exc}", flush=True)
        return 1
    except Exception as exc:  # a crash is a failed check too, with its traceback on stderr
        import traceback

        traceback.print_exc()
        print(
            f"FAIL {args.step} ({time.perf_counter() - started:.0f}s): {type(exc).__name__}: {exc}",
            flush=True,
        )
        return 1
    # a step of several checks returns [(name, failure or None, detail)]: one line each
    checks = detail if isinstance(detail, list) else [(args.step, None, detail)]
    for name, failure, text in checks:
        verdict = "FAIL" if failure else "PASS"
        print(f"{verdict} {name} ({time.perf_counter() - started:.0f}s): {failure or text}", flush=True)
    return 1 if any(failure for _, failure, _ in checks) else 0


if __name__ == "__main__":
    # the steps in device_check_sglang import this module by name: run its copy, not __main__'s,
    # so the exceptions they raise are the ones main() catches
    from miles.train import device_check

    sys.exit(device_check.main())
