"""megatron-core work placed on the CPU stays on the CPU on a machine with a visible GPU.

The checkpoint conversion verifies the converted model's logits on the CPU. megatron-core puts
its rotary frequencies, causal mask and scratch buffer on `torch.cuda.current_device()`, so
the CPU redirects must hold for that work whatever GPUs are visible, and must leave every
other megatron-core call (a GPU training job in the same process) alone.

No GPU exists here, so GPU visibility alone is simulated: `torch.cuda.is_available()` answers
True (and `device_count()` 1) to miles and megatron-core, which is all the conversion looked at
to decide. torch's own internals keep the true answer: on a GPU they would run real CUDA
streams and RNG states (the checkpoint writer, torch.compile), which this machine cannot.
Nothing else is simulated; a CUDA allocation still fails as it does on this CPU build of
torch, which is how a call that escaped the CPU placement shows up.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=9, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]

GPU_VISIBLE = """
import sys, warnings; warnings.simplefilter("ignore")
import torch
# simulated: one GPU is visible to every caller outside torch itself (there is none: CUDA calls fail)
def _visible(real):
    def answer(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return real(*args, **kwargs) if caller.startswith("torch") else {"is_available": True, "device_count": 1}[real.__name__]
    return answer
torch.cuda.is_available = _visible(torch.cuda.is_available)
torch.cuda.device_count = _visible(torch.cuda.device_count)
"""


def _run(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = GPU_VISIBLE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def test_conversion_and_its_logit_check_run_on_cpu_with_a_gpu_visible(tmp_path):
    proc = _run(
        """
        from pathlib import Path
        from miles.ckpt.tiny import make_tiny_checkpoint
        from miles.ckpt.torch_dist import convert_to_torch_dist

        hf = make_tiny_checkpoint("qwen3_moe", 2, Path("hf"), hidden_size=64, intermediate_size=96,
                                  moe_intermediate_size=32, vocab_size=320)
        Path("dist").mkdir()
        convert_to_torch_dist(hf, Path("dist"), "qwen3_moe")  # verify=True: tensors and logits
        print("converted", sorted(p.name for p in Path("dist").iterdir()))
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "converted ['latest_checkpointed_iteration.txt', 'release']" in proc.stdout


def test_the_redirects_hold_inside_cpu_placed_work_only(tmp_path):
    proc = _run(
        """
        from miles.megatron.compat import cpu_placed
        from megatron.core.transformer import utils

        with cpu_placed():
            print("inside", utils.get_default_causal_mask(4).device)
        try:
            utils.get_default_causal_mask(5)
            print("outside", "allocated")
        except (AssertionError, RuntimeError) as exc:  # megatron-core's own device="cuda"
            print("outside", type(exc).__name__, "CUDA" in str(exc))
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["inside cpu", "outside AssertionError True"]
