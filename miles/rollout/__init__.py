"""Rollout-side functions that commands name by the seed framework's module paths (miles.rollout.*)."""
