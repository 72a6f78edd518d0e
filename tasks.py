"""Operator chores: `invoke --list`. Each task is a thin shell over a miles function."""

from __future__ import annotations

from invoke import task


@task(help={"strict": "exit non-zero on error-class findings"})
def audit(c, strict=False):
    """Print the CI audit: disabled tests and their age, coverage gaps, unused suites."""
    c.run(f"python -m miles.ci audit{' --strict' if strict else ''}", pty=False)
