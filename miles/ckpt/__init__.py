"""Checkpoint chores: fetch, validate, trim, FP8, Megatron torch_dist, stage, tiny models."""
