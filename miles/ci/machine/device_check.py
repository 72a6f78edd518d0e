"""The steps of the device check (`scripts/gpu_check.sh` runs them in order).

    python -m miles.ci.machine.device_check STEP [--cpu | --dry-gpus N] [--workdir DIR]

Steps: `platform` (what the machine and the stack are), `parity` (the rollout engine's
per-token logprobs against one full forward, every recipe family, fp32), `generate` (the
rollout engine's greedy decoding against transformers' generate() on a ~0.2B random Qwen3 in
bf16), the training steps of miles.ci.machine.device_check_train (`grpo`, `megatron-parity`,
`megatron-grpo`) and those of miles.ci.machine.device_check_sglang (the SGLang engine, a bf16
Megatron run with SGLang rollouts, a bf16 MoE run, two GPUs). Each prints `PASS <step>: ...`,
`FAIL <step>: ...` or `SKIP <step>: <why>` (a package it needs is missing, or it needs a GPU or
a second one) and exits 1 only on a failure.

`--cpu` runs the same code on CPU at CI size (gloo, fewer rollouts, a smaller model). `--dry-gpus
N` is the GPU form on a machine without one, N GPUs faked (the one place GPU visibility is
faked): nothing runs on a device, every package check runs for real, and each training step
renders the exact command its GPU form runs and puts it through the trainer's start checks
(the flags against the world size and against what the run's components consume, the Megatron
options against the platform) before it is skipped for want of a GPU, saying so. CI runs both
forms, so a change that breaks the script fails before the next GPU machine.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from miles.families import family as family_spec
from miles.families import names as family_names
from miles.megatron import CORE_MODULE

# Distinct lengths (left padding), a GRPO group sharing its prefill, a one-token prompt.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40], [70, 71, 72]] + [[100, 101, 102, 103]] * 4
PARITY_TOL = {"cpu": 1e-5, "gpu": 1e-4}  # fp32; GPU kernels sum in other orders than a full forward
NEAR_TIE = 0.05  # bf16: two tokens whose logprobs differ by less are a tie either side may break


class CheckFailed(RuntimeError):
    pass


# --dry-gpus N: the GPU form with N GPUs faked, nothing run on a device (set by main)
DRY_GPUS: int | None = None


def dry() -> bool:
    """Whether this is the dry form (read at call time: main sets it)."""
    return DRY_GPUS is not None


def dry_note() -> str:
    return f"dry form, {DRY_GPUS} GPU(s) faked by --dry-gpus"


def visible_gpus() -> int:
    """The GPUs this check may use: torch's count, or the dry form's faked one."""
    if DRY_GPUS is not None:
        return DRY_GPUS
    import torch

    return torch.cuda.device_count()


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
    transformers), or None. It is imported after miles, as every miles process imports it (a
    megatron-core imported without miles' import hooks, on a machine without CUDA, would spend
    seconds importing TorchInductor for fusions miles runs eagerly there: miles.megatron.compat)."""
    done = subprocess.run(
        [sys.executable, "-c", f"import miles, {module}"], capture_output=True, text=True, timeout=300
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
    if DRY_GPUS is not None:
        raise Skipped(f"{dry_note()}: needs a GPU to run")
    if not torch.cuda.is_available():
        raise CheckFailed(f"no GPU visible to torch {torch.__version__}; run with --cpu for the CPU form")
    return "cuda:0"


def step_platform(cpu: bool, workdir: Path) -> str:
    import torch

    from miles.platform import resolve

    info = resolve()
    if not cpu and DRY_GPUS is None and info.platform == "cpu":
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
    if DRY_GPUS is not None:
        gpu = f"none used ({dry_note()})"
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

    from miles.ckpt.tiny_cache import tiny_here
    from miles.train.config import SamplingConfig
    from miles.train.model import load_causal_lm
    from miles.train.rollout import TorchRolloutEngine

    device = device_of(cpu)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
    torch.backends.cudnn.allow_tf32 = False
    tol = PARITY_TOL["cpu" if cpu else "gpu"]
    gaps = {}
    for family in family_names():
        # the family's own tiny depth: Qwen3.5's first full-attention layer is its fourth
        layers = family_spec(family).tiny_layers
        path = tiny_here(family, layers, workdir / "tiny" / family, dtype="float32").hf
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


def _steps() -> dict:
    from miles.ci.machine import device_check_sglang, device_check_train

    return {
        "platform": step_platform,
        "parity": step_parity,
        "generate": step_generate,
        **device_check_train.STEPS,
        **device_check_sglang.STEPS,
    }


def main(argv: list[str] | None = None) -> int:
    from miles.exits import OneLineParser

    parser = OneLineParser(prog="python -m miles.ci.machine.device_check", description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=list(_steps()))
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--cpu", action="store_true", help="the same step on CPU at CI size")
    form.add_argument(
        "--dry-gpus",
        type=int,
        metavar="N",
        help="the GPU form with N GPUs faked: checks commands, runs nothing",
    )
    parser.add_argument("--workdir", type=Path, default=Path(".miles/device-check"))
    args = parser.parse_args(argv)
    if args.dry_gpus is not None and args.dry_gpus < 1:
        parser.error(f"--dry-gpus {args.dry_gpus}: fake at least one GPU")
    global DRY_GPUS
    DRY_GPUS = args.dry_gpus
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
    from miles.ci.machine import device_check

    sys.exit(device_check.main())
