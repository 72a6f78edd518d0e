"""The GPU telemetry sampler (miles.telemetry.gpu) on a machine without a GPU.

The first test uses the real nvidia-ml-py as installed: with no libnvidia-ml here, the sampler
must say so. The others need devices, which this machine lacks, so they run the real pynvml
over a stand-in of libnvidia-ml.so.1 (tests/support/fake_nvml.py): only the C entry points
are played, in the library's units (bytes, milliwatts); the conversions, numbering, process
rows and batching under test are the sampler's own. The seed's GPU test of the same sampler
is tests/e2e/test_gpu_sampler_hw.py.
"""

from __future__ import annotations

import inspect
import threading

import pynvml
import pytest

from miles.ci.register import register_cpu_ci
from miles.telemetry.backends import MIB, amd_process_rows, amd_socket_power_w
from miles.telemetry.gpu import GpuSampler, TelemetryBatch
from tests.support.fake_nvml import FakeGpu, FakeLibNvidiaMl, FakeProcess

register_cpu_ci(est_time=1, suite="stage-a-cpu")

GIB = 1 << 30


@pytest.fixture
def fake_gpus(monkeypatch):
    """Two devices behind the stand-in library; restored to "not loaded" afterwards."""
    gpus = [
        FakeGpu(
            uuid="GPU-0aa",
            util_percent=87,
            used_bytes=3 * GIB + 512 * 1024,  # 3 GiB and half a MiB: floors to 3072 MiB
            total_bytes=141 * GIB,
            power_mw=245_678,
            processes=[
                FakeProcess(pid=4242, name="python -m miles.train", used_bytes=2 * GIB),
                FakeProcess(pid=4243, name=None, used_bytes=5 * MIB),
            ],
        ),
        FakeGpu(uuid="GPU-1bb", util_percent=0, used_bytes=0, total_bytes=141 * GIB, power_mw=71_000),
    ]
    library = FakeLibNvidiaMl(pynvml, gpus)
    monkeypatch.setattr(pynvml, "nvmlLib", library)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    return library


def _collecting_sampler(**kwargs) -> tuple[GpuSampler, list[TelemetryBatch]]:
    batches: list[TelemetryBatch] = []
    return GpuSampler(batches.append, node="n0", **kwargs), batches


def test_without_a_gpu_the_sampler_is_unavailable_with_each_librarys_reason(monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlLib", None)  # as on import: nothing loaded yet
    sampler, batches = _collecting_sampler()

    assert not sampler.available
    nvml_reason, amd_reason = sampler.unavailable_reason.split("; ")
    # pynvml's own message for NVML_ERROR_LIBRARY_NOT_FOUND, raised when libnvidia-ml.so.1 won't load
    assert nvml_reason == "NVML: NVML Shared Library Not Found"
    assert amd_reason.startswith("AMD SMI: ") and "amdsmi" in amd_reason
    assert "\n" not in sampler.unavailable_reason
    assert sampler.sample_once(1.0) == 0 and sampler.sample_processes_once(1.0) == 0
    assert sampler.start() is False and sampler.flush() is None and batches == []
    assert sampler.gpu_uuids() == []


def test_nvml_readings_arrive_as_percent_mib_and_watts(fake_gpus):
    sampler, batches = _collecting_sampler()
    assert sampler.available and sampler.backend.name == "NVML"

    assert sampler.sample_once(ts=10.0) == 2
    [batch] = [sampler.flush()]
    first, second = batch.samples
    assert (first.util_percent, first.mem_mib, first.power_w) == (87, 3072, 245.678)
    assert (second.util_percent, second.mem_mib, second.power_w) == (0, 0, 71.0)
    assert {s.ts for s in batch.samples} == {10.0} and {s.node for s in batch.samples} == {"n0"}
    assert batches == [batch]


def test_devices_are_numbered_in_the_librarys_order_with_their_uuids(fake_gpus):
    fake_gpus.gpus.reverse()  # the library's order, not the order of any name or UUID, decides
    sampler, _ = _collecting_sampler()

    assert sampler.gpu_uuids() == ["GPU-1bb", "GPU-0aa"]
    sampler.sample_once(ts=1.0)
    batch = sampler.flush()
    assert [(s.gpu, s.util_percent) for s in batch.samples] == [(0, 0), (1, 87)]


def test_process_rows_name_each_process_and_its_memory(fake_gpus):
    fake_gpus.gpus[1].processes = [FakeProcess(pid=77, name="sglang::scheduler", used_bytes=None)]
    sampler, _ = _collecting_sampler()

    assert sampler.sample_processes_once(ts=2.0) == 3
    batch = sampler.flush()
    assert batch.samples == ()
    assert [(p.gpu, p.pid, p.name, p.mem_mib) for p in batch.processes] == [
        (0, 4242, "python -m miles.train", 2048),
        (0, 4243, "pid 4243", 5),  # exited before its name was asked: named by pid
        (1, 77, "sglang::scheduler", 0),  # memory the driver cannot attribute counts as 0
    ]


def test_a_flush_delivers_everything_since_the_last_one_and_nothing_when_empty(fake_gpus):
    sampler, batches = _collecting_sampler()
    for ts in (1.0, 2.0, 3.0):
        sampler.sample_once(ts)
    sampler.sample_processes_once(3.0)

    sampler.flush()
    assert sampler.flush() is None
    sampler.sample_once(4.0)
    sampler.flush()

    assert len(batches) == 2
    assert [(s.ts, s.gpu) for s in batches[0].samples] == [(t, g) for t in (1.0, 2.0, 3.0) for g in (0, 1)]
    assert len(batches[0].processes) == 2
    assert [(s.ts, s.gpu) for s in batches[1].samples] == [(4.0, 0), (4.0, 1)]
    assert batches[1].processes == ()


def test_a_lost_device_is_skipped_while_the_others_keep_reporting(fake_gpus, caplog):
    sampler, _ = _collecting_sampler()
    fake_gpus.gpus[0].lost = True

    assert sampler.sample_once(1.0) == 1
    assert sampler.sample_once(2.0) == 1
    assert [s.gpu for s in sampler.flush().samples] == [1, 1]
    # named once, not once per tick
    assert [r.getMessage() for r in caplog.records if "gpu 0" in r.getMessage()] == [
        "NVML read failed for gpu 0 on n0: GPU is lost"
    ]


def test_the_thread_samples_flushes_and_stop_delivers_the_rest_and_releases_nvml(fake_gpus):
    first_batch = threading.Event()
    batches: list[TelemetryBatch] = []

    def on_batch(batch):
        batches.append(batch)
        first_batch.set()

    sampler = GpuSampler(on_batch, node="n0", interval=0.01, flush_every=0.05, process_every=0.05)
    assert sampler.start() is True
    with pytest.raises(RuntimeError, match="already started"):
        sampler.start()
    assert first_batch.wait(timeout=60), "no batch arrived from the sampling thread"
    sampler.stop()

    delivered = len(batches)
    assert sampler.flush() is None and len(batches) == delivered  # stop() delivered the remainder
    samples = [s for b in batches for s in b.samples]
    assert samples and {s.gpu for s in samples} == {0, 1}
    assert {p.pid for b in batches for p in b.processes} == {4242, 4243}
    assert fake_gpus.shutdowns == 1 and fake_gpus.initialized == 0
    assert not sampler.available and sampler.sample_once(9.0) == 0


def test_the_stand_in_enforces_what_the_library_does(fake_gpus):
    # before nvmlInit every query fails as the C library's does
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetPowerUsage(pynvml.c_nvmlDevice_t())  # a NULL handle
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(2)
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetMemoryInfo(handle).used == 3 * GIB + 512 * 1024  # bytes
    assert pynvml.nvmlDeviceGetPowerUsage(handle) == 245_678  # milliwatts
    pynvml.nvmlShutdown()
    # the entry points take what pynvml passes them: (handle, out-pointer) for each reading
    for name in ("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetUtilizationRates"):
        assert list(inspect.signature(getattr(fake_gpus, name)).parameters)[0] == "handle"


def test_amd_smi_readings_take_the_first_socket_power_with_a_value():
    # the dict amdsmi_get_power_info returns: "N/A" where a sensor has no reading (0xFFFF)
    assert amd_socket_power_w({"socket_power": 312, "current_socket_power": "N/A"}) == 312.0
    older_part = {"socket_power": "N/A", "current_socket_power": 0xFFFF, "average_socket_power": 95}
    assert amd_socket_power_w(older_part) == 95.0
    assert amd_socket_power_w({"socket_power": "N/A", "current_socket_power": "N/A"}) == 0.0


def test_amd_smi_process_rows_drop_processes_holding_no_vram():
    # the rows amdsmi_get_gpu_process_list returns; per-process vram_mem is in bytes
    rows = amd_process_rows(
        [
            {"name": "python3", "pid": 11, "memory_usage": {"vram_mem": 3 * GIB, "gtt_mem": 0, "cpu_mem": 0}},
            {"name": "N/A", "pid": 12, "memory_usage": {"vram_mem": 64 * MIB}},
            {"name": "Xorg", "pid": 13, "memory_usage": {"vram_mem": 0}},
        ]
    )
    assert [(r.pid, r.name, r.mem_mib) for r in rows] == [(11, "python3", 3072), (12, "pid 12", 64)]


@pytest.mark.parametrize("argument", ["interval", "flush_every", "process_every"])
def test_a_non_positive_period_is_refused_by_name(argument):
    with pytest.raises(ValueError, match=f"{argument}=0: must be a positive number of seconds"):
        GpuSampler(lambda batch: None, backends=(), **{argument: 0})
