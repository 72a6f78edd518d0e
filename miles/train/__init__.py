"""The RL core: `python -m miles.train <flags>` trains a policy with GRPO/GSPO.

args (flags) -> runtime (setup) -> trainer (the loop) over data, rollout engines, rewards,
algorithm (losses), backends (FSDP2/DDP, Megatron), checks, checkpoint and report.
Nothing here is imported by miles.ci; torch and transformers load only when a run starts.
"""
