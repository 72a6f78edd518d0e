"""The GPU lanes' preflight for Transformer Engine: it imports, at the version the stack states,
and megatron-core builds its TE layer spec and FusedAdam with it.

`import transformer_engine` loads TE's core library and torch extension, and a broken install
fails there with errors megatron-core's own guards do not catch (a missing cuDNN, mismatched
package versions, an extension built for another torch), so the import runs in a child
process with a timeout; each problem is one line. The stack's statement of TE is
miles.image.te's (the lock on CUDA, images.toml on ROCm). Standard library only.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

IMPORT_TIMEOUT_S = 120
DISTRIBUTIONS = ("transformer-engine", "transformer-engine-cu13", "transformer-engine-torch")

_PROBE = f"""
import importlib.metadata as m, json
DISTRIBUTIONS = {DISTRIBUTIONS!r}
out = {{"versions": {{}}}}
for name in DISTRIBUTIONS:
    try:
        out["versions"][name] = m.version(name)
    except m.PackageNotFoundError:
        pass
try:
    import transformer_engine.pytorch  # the core library, cuDNN and the torch extension load here
    out["import"] = "ok"
except BaseException as exc:
    text = str(exc).strip()
    out["import"] = type(exc).__name__ + (": " + text.splitlines()[0] if text else "")
if out["import"] == "ok":
    try:
        from miles.megatron.spec import core_te_usage
        out.update(core_te_usage())
    except BaseException as exc:
        out["megatron_te"] = type(exc).__name__
print(json.dumps(out))
"""


def check_transformer_engine(lane: str, root: Path, python: str = sys.executable) -> list[str]:
    """One line per problem with the lane's Transformer Engine; [] for a stack without TE."""
    from miles.ci.machine.stacks import stack_for_lane
    from miles.image.pins import versions_match
    from miles.image.te import expected_version, te_sources

    stack = stack_for_lane(lane)
    source = te_sources().get(stack.name)
    if source is None:
        return []
    expected = expected_version(root, stack.name)
    image = "docker/Dockerfile" if source.source == "lock" else "docker/Dockerfile.rocm"
    try:
        done = subprocess.run(
            [python, "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=IMPORT_TIMEOUT_S,
            check=False,
            cwd=root,
        )
    except subprocess.TimeoutExpired:
        return [
            f"transformer-engine: importing it took over {IMPORT_TIMEOUT_S} s; the GPU or its driver is stuck"
        ]
    if done.returncode != 0 or not done.stdout.strip():
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [f"transformer-engine: the import check died (exit {done.returncode}): {tail}"]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    if not found["versions"]:
        return [
            f"transformer-engine: not installed ({found['import']}); the lane's Megatron jobs build its layer "
            f"spec: use the image {image} builds"
        ]
    problems = []
    if found["import"] != "ok":
        problems.append(
            f"transformer-engine: import transformer_engine.pytorch failed: {found['import']}; use the image "
            f"{image} builds, which builds and checks it"
        )
    wanted = [DISTRIBUTIONS[0]] + (
        [*source.packages[1:], source.extension] if source.source == "lock" else []
    )
    if expected is not None:
        version, where = expected
        wrong = [
            f"{name} {found['versions'].get(name, 'missing')}"
            for name in wanted
            if not versions_match(version, found["versions"].get(name, ""))
        ]
        if wrong:
            problems.append(f"transformer-engine: installed {', '.join(wrong)}; {where} pins {version}")
    if found["import"] != "ok":
        return problems
    if found.get("megatron_te") is not True:
        problems.append(
            "transformer-engine: it imports, but megatron-core does not build its TE spec with it "
            f"(HAVE_TE: {found.get('megatron_te')})"
        )
    elif not found.get("fused_adam"):
        problems.append(
            "transformer-engine: megatron-core's optimizer falls back to torch's AdamW, not TE's FusedAdam"
        )
    return problems
