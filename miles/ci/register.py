"""Markers a test file calls at top level to say where it runs.

They do nothing when the test runs: `miles.ci.registry.discover` reads them from the file's syntax
tree without importing it. Write them as top-level calls with literal arguments:

    from miles.ci.register import register_cuda_ci, register_rocm_ci

    register_cuda_ci(est_time=300, suite="stage-c-4-gpu-h200", labels=["megatron"])
    register_rocm_ci(est_time=390, suite="stage-c-4-gpu-mi350", labels=["megatron", "amd"])

`est_time` (seconds) balances shards and sets the per-file timeout; `disabled="<diagnosis
or tracking link>"` keeps the test reported but not run; `nightly=True` admits it only to
nightly, weekly and release runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def register_cpu_ci(
    est_time: float,
    suite: str,
    *,
    labels: Sequence[str] = (),
    nightly: bool = False,
    disabled: str | None = None,
) -> None:
    """Run this file on the CPU backend in `suite`."""


def register_cuda_ci(
    est_time: float,
    suite: str,
    *,
    labels: Sequence[str] = (),
    nightly: bool = False,
    disabled: str | None = None,
) -> None:
    """Run this file on NVIDIA GPUs in `suite`; GPU registrations need at least one label."""


def register_rocm_ci(
    est_time: float,
    suite: str,
    *,
    labels: Sequence[str] = (),
    nightly: bool = False,
    disabled: str | None = None,
) -> None:
    """Run this file on AMD GPUs in `suite`; GPU registrations need at least one label."""


def register_ci_gate(
    *,
    metric_key: str,
    steps: str | Sequence[int] = "last",
    constraint: Mapping[str, float] | None = None,
    enforce: bool = False,
) -> None:
    """Gate a training metric of this test against its history for the same backend and suite."""


# Name -> backend, for discovery. register_ci_gate has no backend: it applies to every
# registration of the file.
BACKEND_OF_MARKER = {
    "register_cpu_ci": "cpu",
    "register_cuda_ci": "cuda",
    "register_rocm_ci": "rocm",
}
GATE_MARKER = "register_ci_gate"
MARKERS = (*BACKEND_OF_MARKER, GATE_MARKER)
