"""The CPU redirects of megatron-core's CUDA assumptions, and its other patches: each one is needed, each current.

`stale()` is the upgrade alarm: an entry whose function is gone, or whose source no longer
holds the assumption it works around (or another megatron-core release), fails here with the
entry named. The necessity cases
call a few redirected functions in a fresh interpreter without and with `install()`: the
first must fail the way megatron-core fails on a CPU build of torch, the second must work.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=15, suite="stage-a-cpu")


def test_every_redirect_still_describes_the_installed_megatron_core():
    from miles.megatron import compat

    assert compat.stale() == []


def test_a_redirect_whose_assumption_is_gone_is_reported_by_name(monkeypatch):
    from miles.megatron import compat

    wrong = compat.Redirect("megatron.core.utils:GlobalMemoryBuffer.get_tensor", 'device="mps"', "made up")
    missing = compat.Redirect("megatron.core.utils:NoSuchThing.run", "x", "gone")
    monkeypatch.setattr(compat, "REDIRECTS", (*compat.REDIRECTS, wrong, missing))
    problems = compat.stale()
    assert len(problems) == 2
    assert "GlobalMemoryBuffer.get_tensor" in problems[0] and "'device=\"mps\"'" in problems[0]
    assert problems[1].startswith("megatron.core.utils:NoSuchThing.run: not found")


def test_a_patch_whose_reason_is_gone_is_reported_by_name(monkeypatch):
    from miles.megatron import compat

    fixed = compat.Patch(
        "megatron.core.utils:GlobalMemoryBuffer.get_tensor", "torch.cuda", "made up", present=False
    )
    gone = compat.Patch("megatron.core.utils:GlobalMemoryBuffer.get_tensor", "no such text", "made up")
    monkeypatch.setattr(compat, "PATCHES", (fixed, gone))
    problems = compat.stale()
    assert problems[0].endswith("its source now contains 'torch.cuda' (made up)")
    assert problems[1].endswith("its source no longer contains 'no such text' (made up)")


def test_another_megatron_core_release_is_reported(monkeypatch):
    from miles.megatron import compat

    monkeypatch.setattr(compat, "KNOWN_RELEASE", "0.15.0")
    assert compat.stale()[0].startswith(
        "megatron-core 0.16.1 is installed; every entry here was written for 0.15.0"
    )


CASES = {
    "attention scratch buffer": (
        "from megatron.core.utils import GlobalMemoryBuffer\n"
        "t = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, 'x')\n"
        "assert t.device.type == 'cpu'"
    ),
    "causal mask": (
        "from megatron.core.transformer.utils import get_default_causal_mask\n"
        "assert get_default_causal_mask(4).device.type == 'cpu'"
    ),
    "model-parallel RNG streams": (
        "from megatron.core import parallel_state\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "parallel_state.initialize_model_parallel(1, 1)\n"
        "from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed\n"
        "model_parallel_cuda_manual_seed(5)\n"
        "with get_cuda_rng_tracker().fork():\n"
        "    a = torch.rand(3)\n"
        "with get_cuda_rng_tracker().fork():\n"
        "    b = torch.rand(3)\n"
        "assert not torch.equal(a, b)  # the stream advanced inside the fork\n"
    ),
    "rotary table of MLA and the DSA indexer": (
        "from megatron.core.models.common.embeddings import RotaryEmbedding\n"
        "assert RotaryEmbedding(16, rotary_percent=1.0).inv_freq.device.type == 'cpu'"
    ),
    "router with expert bias": (
        "import torch.distributed as dist\n"
        "from megatron.core import parallel_state\n"
        "if not dist.is_initialized():\n"
        "    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "if not parallel_state.model_parallel_is_initialized():\n"
        "    parallel_state.initialize_model_parallel(1, 1)\n"
        "from megatron.core.transformer import TransformerConfig\n"
        "from megatron.core.transformer.moe.router import TopKRouter\n"
        "from megatron.core.process_groups_config import ProcessGroupCollection\n"
        "tc = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4,\n"
        "    moe_router_topk=2, moe_router_score_function='sigmoid', moe_router_enable_expert_bias=True,\n"
        "    use_cpu_initialization=True, moe_ffn_hidden_size=8)\n"
        "router = TopKRouter(tc, pg_collection=ProcessGroupCollection.use_mpu_process_groups())\n"
        "assert router.expert_bias.device.type == 'cpu'"
    ),
}


def _outcomes(install: bool) -> dict[str, str]:
    """Run every case in one fresh interpreter; {case: "ok" or the error it raised}."""
    lines = ["import warnings; warnings.simplefilter('ignore')", "import json, torch", "out = {}"]
    if install:
        lines.append("from miles.megatron import compat; compat.install()")
    for name, body in CASES.items():
        lines.append("try:")
        lines += ["    " + line for line in body.splitlines()]
        lines.append(f"    out[{name!r}] = 'ok'")
        lines.append("except Exception as exc:")
        lines.append(f"    out[{name!r}] = f'{{type(exc).__name__}}: {{exc}}'")
    lines.append("print(json.dumps(out))")
    proc = subprocess.run(
        [sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_each_redirect_is_what_makes_its_call_work_on_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs megatron-core's CUDA paths as they are")
    without = _outcomes(install=False)
    for case, outcome in without.items():
        assert "CUDA" in outcome, f"{case}: works without the redirect ({outcome}); the entry may be unneeded"
    assert _outcomes(install=True) == dict.fromkeys(CASES, "ok")


def test_outside_a_redirected_call_torch_cuda_is_left_alone():
    import torch

    from miles.megatron import compat

    compat.install()
    before = torch.cuda.current_device
    from megatron.core.utils import GlobalMemoryBuffer

    GlobalMemoryBuffer().get_tensor((2,), torch.float32, "probe")
    assert torch.cuda.current_device is before


def test_without_cuda_megatron_cores_fusions_run_eagerly_and_inductor_is_never_imported():
    # a fresh interpreter: miles first (as every miles process), then megatron-core's fusions
    code = (
        "import sys, miles, torch\n"
        "from megatron.core.fusions import fused_bias_swiglu\n"
        "from megatron.core.transformer.moe import router\n"
        "import megatron.core.jit as jit\n"
        "x = torch.randn(3, 8)\n"
        "assert torch.equal(fused_bias_swiglu.swiglu(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])\n"
        "print(jit.jit_fuser is jit.noop_decorator, torch.cuda.is_available(),\n"
        "      'torch._inductor.compile_fx' in sys.modules, type(router.TopKRouter._apply_expert_bias).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # eager: the identity decorator, no TorchInductor, the router's function a plain function
    assert done.stdout.split() == ["True", "False", "False", "function"], done.stdout


def test_megatron_core_imported_before_miles_keeps_its_compiled_fusions():
    # the patch decides at megatron-core's import: one already imported is left as it is
    code = "import megatron.core.jit as jit, miles\nprint(jit.jit_fuser is jit.noop_decorator)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False"]


def test_a_lift_whose_caller_dropped_it_or_whose_body_now_allocates_on_cuda_is_reported(monkeypatch):
    from miles.megatron import compat

    not_called = compat.Lift(
        "megatron.core.pipeline_parallel.schedules:backward_step",
        "megatron.core.utils:GlobalMemoryBuffer.get_tensor",
        "made up",
    )
    allocates = compat.Lift("megatron.core.utils:GlobalMemoryBuffer.get_tensor", compat._SCHEDULE, "made up")
    monkeypatch.setattr(compat, "LIFTS", (not_called, allocates))
    problems = compat.stale()
    assert problems[0].endswith("GlobalMemoryBuffer.get_tensor no longer calls it (made up)")
    assert "get_tensor: its source now mentions CUDA" in problems[-1] and "torch.cuda" in problems[-1]
    assert len(problems) == 3  # the made-up pair also names a schedule that never called get_tensor


def test_inside_a_redirected_schedule_a_lifted_step_runs_without_the_mode_and_its_redirects_with_it():
    # a fresh interpreter (install() wraps megatron-core for the process): the schedule's
    # microbatch forward runs with no function mode (every torch call there would go through
    # Python), a scratch buffer the model asks for inside it is still placed on the CPU
    code = """
import warnings; warnings.simplefilter("ignore")
import json, torch
from torch.overrides import _len_torch_function_stack
from miles.megatron import compat
compat.install()
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import GlobalMemoryBuffer
seen = {}
def probe():
    seen["modes_in_step"] = _len_torch_function_stack()
    seen["buffer"] = GlobalMemoryBuffer().get_tensor((2,), torch.float32, "probe").device.type
def fake_step(*args, **kwargs):
    probe()
lifted = compat._lift(fake_step)
with compat.on_cpu():
    seen["modes_in_schedule"] = _len_torch_function_stack()
    lifted()
seen["forward_step_lifted"] = getattr(schedules.forward_step, "__miles_cpu_lift__", False)
seen["backward_step_lifted"] = getattr(schedules.backward_step, "__miles_cpu_lift__", False)
print(json.dumps(seen))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "modes_in_schedule": 1, "modes_in_step": 0, "buffer": "cpu",
        "forward_step_lifted": True, "backward_step_lifted": True,
    }  # fmt: skip
