"""What the machine's GPUs are doing while miles runs: utilisation, memory, power, processes.

`miles.telemetry.gpu.GpuSampler` reads every device through the vendor's management library
(NVML on NVIDIA, AMD SMI on ROCm) and hands batches of samples to a callback. It imports no
torch and no vendor library until it is opened, so anything may import this package.
"""
