"""A stand-in for libnvidia-ml.so.1, the C library NVML's Python bindings call.

No NVIDIA driver exists on the CPU machines, so the tests put this object where nvidia-ml-py
keeps the loaded library (`pynvml.nvmlLib`): every `pynvml.nvml*` function the sampler calls
then runs its real Python unchanged (ctypes structures, unit fields, the two-call process
listing, the NVMLError subclass per return code) and only the C entry points are played here.
Each entry point takes the arguments pynvml 13.615.71 passes it (`fn(handle, byref(struct))`,
string buffers with their length) and returns an NVML status code, as the C API does: units
are the library's (memory in bytes, power in milliwatts, utilisation in percent), a call
before nvmlInit returns NVML_ERROR_UNINITIALIZED and a handle no device was given for returns
NVML_ERROR_INVALID_ARGUMENT.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field


@dataclass
class FakeProcess:
    pid: int
    name: str | None  # None: the process is gone, its name lookup fails with NOT_FOUND
    used_bytes: int | None  # None: the driver cannot attribute memory (NVML_VALUE_NOT_AVAILABLE)


@dataclass
class FakeGpu:
    uuid: str
    util_percent: int
    used_bytes: int
    total_bytes: int
    power_mw: int
    processes: list[FakeProcess] = field(default_factory=list)
    lost: bool = False  # fell off the bus: every query returns NVML_ERROR_GPU_IS_LOST


class FakeLibNvidiaMl:
    """The C entry points, by their exported names, over `gpus`."""

    def __init__(self, pynvml, gpus: list[FakeGpu]):
        self._nvml = pynvml
        self.gpus = gpus
        self._devices = [pynvml.struct_c_nvmlDevice_t() for _ in gpus]
        self.initialized = 0
        self.shutdowns = 0

    # --- lifecycle ---------------------------------------------------------------------------

    def nvmlInitWithFlags(self, flags):
        self.initialized += 1
        return self._nvml.NVML_SUCCESS

    def nvmlShutdown(self):
        if not self.initialized:
            return self._nvml.NVML_ERROR_UNINITIALIZED
        self.initialized -= 1
        self.shutdowns += 1
        return self._nvml.NVML_SUCCESS

    # --- enumeration -------------------------------------------------------------------------

    def nvmlDeviceGetCount_v2(self, count_ref):
        if not self.initialized:
            return self._nvml.NVML_ERROR_UNINITIALIZED
        count_ref._obj.value = len(self.gpus)
        return self._nvml.NVML_SUCCESS

    def nvmlDeviceGetHandleByIndex_v2(self, index, device_ref):
        if not self.initialized:
            return self._nvml.NVML_ERROR_UNINITIALIZED
        if not 0 <= index.value < len(self.gpus):
            return self._nvml.NVML_ERROR_INVALID_ARGUMENT
        device_ref._obj.contents = self._devices[index.value]
        return self._nvml.NVML_SUCCESS

    def nvmlDeviceGetUUID(self, handle, buffer, length):
        return self._query(handle, lambda gpu: self._write_string(buffer, length, gpu.uuid))

    # --- readings ----------------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle, util_ref):
        def fill(gpu):
            util_ref._obj.gpu = gpu.util_percent
            util_ref._obj.memory = 0

        return self._query(handle, fill)

    def nvmlDeviceGetMemoryInfo(self, handle, memory_ref):
        def fill(gpu):
            memory_ref._obj.total = gpu.total_bytes
            memory_ref._obj.used = gpu.used_bytes
            memory_ref._obj.free = gpu.total_bytes - gpu.used_bytes

        return self._query(handle, fill)

    def nvmlDeviceGetPowerUsage(self, handle, milliwatts_ref):
        return self._query(handle, lambda gpu: setattr(milliwatts_ref._obj, "value", gpu.power_mw))

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle, count_ref, infos):
        gpu, status = self._device(handle)
        if gpu is None:
            return status
        wanted = len(gpu.processes)
        if infos is None:  # the sizing call: SUCCESS means "none", INSUFFICIENT_SIZE "this many"
            count_ref._obj.value = wanted
            return self._nvml.NVML_SUCCESS if wanted == 0 else self._nvml.NVML_ERROR_INSUFFICIENT_SIZE
        if count_ref._obj.value < wanted:
            count_ref._obj.value = wanted
            return self._nvml.NVML_ERROR_INSUFFICIENT_SIZE
        for slot, process in zip(infos, gpu.processes, strict=False):
            slot.pid = process.pid
            not_available = self._nvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
            slot.usedGpuMemory = not_available if process.used_bytes is None else process.used_bytes
        count_ref._obj.value = wanted
        return self._nvml.NVML_SUCCESS

    def nvmlSystemGetProcessName(self, pid, buffer, length):
        if not self.initialized:
            return self._nvml.NVML_ERROR_UNINITIALIZED
        for gpu in self.gpus:
            for process in gpu.processes:
                if process.pid == pid.value and process.name is not None:
                    return self._write_string(buffer, length, process.name)
        return self._nvml.NVML_ERROR_NOT_FOUND

    # --- helpers -----------------------------------------------------------------------------

    def _device(self, handle):
        if not self.initialized:
            return None, self._nvml.NVML_ERROR_UNINITIALIZED
        try:
            address = ctypes.addressof(handle.contents)
        except ValueError:  # a NULL handle
            return None, self._nvml.NVML_ERROR_INVALID_ARGUMENT
        for device, gpu in zip(self._devices, self.gpus, strict=True):
            if ctypes.addressof(device) == address:
                return (None, self._nvml.NVML_ERROR_GPU_IS_LOST) if gpu.lost else (gpu, None)
        return None, self._nvml.NVML_ERROR_INVALID_ARGUMENT

    def _query(self, handle, fill) -> int:
        gpu, status = self._device(handle)
        if gpu is None:
            return status
        return fill(gpu) or self._nvml.NVML_SUCCESS

    def _write_string(self, buffer, length, text: str) -> int:
        encoded = text.encode()
        if len(encoded) + 1 > length.value:
            return self._nvml.NVML_ERROR_INSUFFICIENT_SIZE
        buffer.value = encoded
        return self._nvml.NVML_SUCCESS
