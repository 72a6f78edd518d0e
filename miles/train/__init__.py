"""The RL core: `python -m miles.train <flags>` trains a policy with GRPO/GSPO.

config (the flags as typed sections) -> args (parse, validate) -> runtime (setup; each
backend and engine gets the sections it declares in consumption) -> trainer (the loop) over
data, rollout engines, rewards, algorithm (losses), backends (FSDP2/DDP, Megatron), checks,
checkpoint and report.
It imports nothing of miles.recipes or miles.ci (the device check, miles.ci.machine, drives it);
torch and transformers load only when a run starts.
"""
