"""The cpu lane's sglang (requirements/cpu-sglang.txt) is the GPU lanes' sglang, version for
version, so the adapter tests on CPU check the package the GPU lanes run."""

from __future__ import annotations

from pathlib import Path

from miles.ci.register import register_cpu_ci
from miles.image.pins import parse_lock

register_cpu_ci(est_time=2, suite="stage-a-cpu")

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements"


def test_every_cpu_sglang_pin_equals_the_gpu_lanes_pins():
    cpu_sglang = parse_lock(REQUIREMENTS / "cpu-sglang.txt").pins
    cpu = parse_lock(REQUIREMENTS / "cpu.txt").pins
    for stack in ("cuda-h200.txt", "rocm-mi350.txt"):
        gpu = parse_lock(REQUIREMENTS / stack).pins
        differing = {
            name: (pin.version, gpu[name].version if name in gpu else None)
            for name, pin in cpu_sglang.items()
            if name not in gpu or gpu[name].version != pin.version
        }
        assert not differing, f"requirements/cpu-sglang.txt vs requirements/{stack}: {differing}"
    assert "sglang" in cpu_sglang
    assert not set(cpu_sglang) & set(cpu), "a package pinned in both cpu.txt and cpu-sglang.txt"
