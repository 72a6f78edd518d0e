"""The machine a lane runs on: preflight checks and the GPU stack it needs."""
