"""The one exception type the checkpoint chores raise for bad input."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint (or a step's input) breaks a rule; the message names file, tensor, rule and fix."""


class StepFailed(CheckpointError):
    """A pipeline step stopped; nothing of it was marked done and its inputs are untouched."""
