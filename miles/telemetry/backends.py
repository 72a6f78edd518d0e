"""The two management libraries a GPU sampler reads, behind one small interface.

Each backend turns its library's units into the sampler's: utilisation in percent (0-100),
memory in MiB, power in watts. NVML (`pynvml`, from the nvidia-ml-py package) reports memory
in bytes and power in milliwatts; AMD SMI (`amdsmi`, shipped with ROCm) reports device VRAM
in MiB, per-process VRAM in bytes and socket power in watts, and writes "N/A" where a sensor
has no reading.
"""

from __future__ import annotations

import contextlib
import importlib
import io
from dataclasses import dataclass
from typing import Any, Protocol

MIB = 1 << 20
# AMD SMI's "no reading" for 16-bit sensors (amdsmi_interface: `if value == 0xFFFF: "N/A"`)
_AMD_NO_READING = 0xFFFF


@dataclass(frozen=True)
class DeviceReading:
    util_percent: int
    mem_mib: int
    power_w: float


@dataclass(frozen=True)
class ProcessReading:
    pid: int
    name: str
    mem_mib: int


class Backend(Protocol):
    name: str

    def open(self) -> list[Any]:
        """Initialise the library; the handle of every device, in the library's order."""

    def uuid(self, handle: Any) -> str: ...

    def read_device(self, handle: Any) -> DeviceReading: ...

    def read_processes(self, handle: Any) -> list[ProcessReading]: ...

    def close(self) -> None: ...


class Nvml:
    """NVIDIA's NVML through nvidia-ml-py (`import pynvml`)."""

    name = "NVML"

    def __init__(self, api: Any | None = None):
        self._api = api

    def open(self) -> list[Any]:
        if self._api is None:
            self._api = importlib.import_module("pynvml")
        self._api.nvmlInit()
        count = self._api.nvmlDeviceGetCount()
        if count == 0:
            self._api.nvmlShutdown()
            raise RuntimeError("the driver reports no devices")
        return [self._api.nvmlDeviceGetHandleByIndex(index) for index in range(count)]

    def uuid(self, handle: Any) -> str:
        return _text(self._api.nvmlDeviceGetUUID(handle))

    def read_device(self, handle: Any) -> DeviceReading:
        return DeviceReading(
            util_percent=int(self._api.nvmlDeviceGetUtilizationRates(handle).gpu),
            mem_mib=int(self._api.nvmlDeviceGetMemoryInfo(handle).used) // MIB,
            power_w=int(self._api.nvmlDeviceGetPowerUsage(handle)) / 1000,
        )

    def read_processes(self, handle: Any) -> list[ProcessReading]:
        rows = []
        for process in self._api.nvmlDeviceGetComputeRunningProcesses(handle):
            pid = int(process.pid)
            try:
                name = _text(self._api.nvmlSystemGetProcessName(pid))
            except self._api.NVMLError:
                name = f"pid {pid}"  # it exited between the listing and the lookup
            # usedGpuMemory is None where the driver cannot attribute memory (WDDM)
            rows.append(ProcessReading(pid, name, int(process.usedGpuMemory or 0) // MIB))
        return rows

    def close(self) -> None:
        self._api.nvmlShutdown()


class AmdSmi:
    """AMD SMI through the `amdsmi` package ROCm ships (/opt/rocm/share/amd_smi)."""

    name = "AMD SMI"

    def __init__(self, api: Any | None = None):
        self._api = api

    def open(self) -> list[Any]:
        if self._api is None:
            self._api = _import_amdsmi()
        self._api.amdsmi_init()
        handles = list(self._api.amdsmi_get_processor_handles())
        if not handles:
            self._api.amdsmi_shut_down()
            raise RuntimeError("the driver reports no devices")
        return handles

    def uuid(self, handle: Any) -> str:
        return _text(self._api.amdsmi_get_gpu_device_uuid(handle))

    def read_device(self, handle: Any) -> DeviceReading:
        activity = self._api.amdsmi_get_gpu_activity(handle)["gfx_activity"]
        if activity == "N/A":
            raise RuntimeError("AMD SMI has no graphics activity reading")
        return DeviceReading(
            util_percent=int(activity),
            mem_mib=int(self._api.amdsmi_get_gpu_vram_usage(handle)["vram_used"]),
            power_w=amd_socket_power_w(self._api.amdsmi_get_power_info(handle)),
        )

    def read_processes(self, handle: Any) -> list[ProcessReading]:
        return amd_process_rows(self._api.amdsmi_get_gpu_process_list(handle))

    def close(self) -> None:
        self._api.amdsmi_shut_down()


def amd_socket_power_w(power: dict) -> float:
    """Socket power in W from amdsmi_get_power_info: MI300 and later fill `socket_power`,
    older parts one of the other two; 0.0 when no field has a reading."""
    for field in ("socket_power", "current_socket_power", "average_socket_power"):
        value = power.get(field, "N/A")
        if value != "N/A" and 0 <= int(value) < _AMD_NO_READING:
            return float(value)
    return 0.0


def amd_process_rows(processes: list[dict]) -> list[ProcessReading]:
    """Rows from amdsmi_get_gpu_process_list. The kernel driver also lists processes that
    merely opened the device; those holding no VRAM are dropped, as NVML lists only
    compute processes with memory."""
    rows = []
    for process in processes:
        mem_mib = int((process.get("memory_usage") or {}).get("vram_mem") or 0) // MIB
        if mem_mib == 0:
            continue
        pid = int(process["pid"])
        name = process.get("name")
        rows.append(ProcessReading(pid, str(name) if name and name != "N/A" else f"pid {pid}", mem_mib))
    return rows


def _import_amdsmi() -> Any:
    # amdsmi prints, then fails with KeyError('libamd_smi.so'), when the library is absent
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            return importlib.import_module("amdsmi")
    except KeyError as error:
        raise RuntimeError(f"amdsmi is installed but could not load {error.args[0]}") from error


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
