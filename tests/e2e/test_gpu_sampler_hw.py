"""The GPU telemetry sampler (miles.telemetry.gpu) against the runner's real GPUs.

The seed framework's hardware test of its sampler (radixark/miles 31f1ca961,
tests/fast-gpu/test_gpu_sampler_hw.py) checks that NVML opens on NVIDIA and AMD SMI on ROCm,
and that every device of a multi-GPU runner reports a UUID, utilisation within 0-100, and
non-negative memory and power, numbered in order, in one flushed batch. The same checks here;
the CPU side (units, numbering, process rows, batching over pynvml) is
tests/unit/test_telemetry_gpu.py.
"""

from __future__ import annotations

from miles.ci.register import register_cuda_ci, register_rocm_ci
from miles.telemetry.gpu import GpuSampler, TelemetryBatch

register_cuda_ci(est_time=60, suite="stage-b-2-gpu-h200", labels=["short"])
register_rocm_ci(est_time=60, suite="stage-c-4-gpu-mi350", labels=["amd"])


def test_the_backend_that_opens_is_the_one_for_the_hardware():
    import torch

    sampler = GpuSampler(lambda batch: None, node="ci")
    assert sampler.available, f"no GPU telemetry backend opened on a GPU runner: {sampler.unavailable_reason}"
    assert sampler.backend.name == ("AMD SMI" if torch.version.hip else "NVML")
    sampler.stop()


def test_every_device_reports_its_readings_and_processes_in_one_batch():
    import torch

    torch.ones(1 << 20, device="cuda")  # this process holds memory on a device while listed
    batches: list[TelemetryBatch] = []
    sampler = GpuSampler(batches.append, node="ci")
    assert sampler.available, sampler.unavailable_reason

    uuids = sampler.gpu_uuids()
    assert len(uuids) >= 2, f"expected a multi-GPU runner, saw {len(uuids)} device(s)"
    assert all(uuids) and len(uuids) == sampler.device_count

    assert sampler.sample_once(ts=1.0) == len(uuids)
    listed = sampler.sample_processes_once(ts=1.0)
    sampler.stop()

    [batch] = batches
    assert [sample.gpu for sample in batch.samples] == list(range(len(uuids)))
    for sample in batch.samples:
        assert 0 <= sample.util_percent <= 100
        assert sample.mem_mib >= 0 and sample.power_w >= 0
    assert len(batch.processes) == listed
    for process in batch.processes:
        assert process.pid > 0 and process.name and process.mem_mib >= 0
