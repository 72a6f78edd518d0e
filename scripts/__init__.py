"""Training recipe scripts: run_<model>.py; amd/run_<model>.py are their ROCm forms."""
