"""Submitting a plan of several nodes to a Ray cluster and following it to its end.

The plan's command is `ray job submit --address URL --runtime-env-json ENV -- ENTRYPOINT`;
this does the same through Ray's job SDK (`JobSubmissionClient`), so the run's exit code is the
job driver's own (the CLI answers 1 for any failure): it submits the entrypoint with the plan's
environment (and the caller's MILES_* variables, such as the metric record directory), streams
the job's log here as it is written, and returns the driver's exit code once the job ends.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
from collections.abc import Mapping

from miles.recipes.launch import LaunchError, LaunchPlan


def parts(plan: LaunchPlan) -> tuple[str, dict[str, str], str]:
    """(dashboard address, environment, entrypoint) of a Ray plan's `ray job submit` command."""
    import json

    command = list(plan.command)
    if command[:3] != ["ray", "job", "submit"] or "--" not in command:
        raise LaunchError(f"{plan.recipe}: not a Ray job command: {shlex.join(command[:6])} ...")
    options, entrypoint = command[3 : command.index("--")], command[command.index("--") + 1 :]
    address = options[options.index("--address") + 1]
    env = json.loads(options[options.index("--runtime-env-json") + 1])["env_vars"]
    return address, env, shlex.join(entrypoint)


def submit(plan: LaunchPlan, caller_env: Mapping[str, str], *, out=None) -> int:
    out = sys.stdout if out is None else out  # the stream of the call, not of the import
    try:
        from ray.job_submission import JobStatus, JobSubmissionClient
    except ImportError as exc:
        raise LaunchError(
            f"{plan.recipe}: a {plan.profile.nodes}-node run is a Ray job and ray is not installed ({exc}); "
            "install the lane's stack (requirements/cpu.txt pins ray[default])"
        ) from None
    address, env, entrypoint = parts(plan)
    env = {**env, **{k: v for k, v in caller_env.items() if k.startswith("MILES_")}}
    try:
        client = JobSubmissionClient(address)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise LaunchError(
            f"{plan.recipe}: no Ray cluster answers at {address} ({exc}); start one with the node setup commands "
            "of `--dry-run`, or give its dashboard address"
        ) from None
    job = client.submit_job(entrypoint=entrypoint, runtime_env={"env_vars": env})
    print(f"miles: submitted Ray job {job} to {address}", file=out, flush=True)

    async def follow() -> None:
        async for lines in client.tail_job_logs(job):
            out.write(lines)
            out.flush()

    asyncio.run(follow())
    info = client.get_job_info(job)
    code = getattr(info, "driver_exit_code", None)
    if code is None:
        code = 0 if info.status == JobStatus.SUCCEEDED else 1
    print(f"miles: Ray job {job} {info.status}, exit code {code}", file=out, flush=True)
    return int(code)
