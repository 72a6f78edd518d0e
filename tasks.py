"""Operator chores: `invoke --list`. Each task is a thin shell over a miles function."""

from __future__ import annotations

from invoke import task


@task(help={"strict": "exit non-zero on error-class findings"})
def audit(c, strict=False):
    """Print the CI audit: disabled tests and their age, coverage gaps, unused suites."""
    c.run(f"python -m miles.ci audit{' --strict' if strict else ''}", pty=False)


@task(
    help={
        "stack": "one stack (cpu, cuda-h200, rocm-mi350); default: all of them",
        "upgrade": "move to the newest versions the inputs allow instead of keeping the locked ones",
    },
    iterable=["stack"],
)
def lock(c, stack=None, upgrade=False):
    """Regenerate requirements/<stack>.txt from requirements/<stack>.in with uv (needs PyPI)."""
    from pathlib import Path

    from miles.image.config import load_images
    from miles.image.lock import lock_stack

    root = Path(__file__).resolve().parent
    config = load_images()
    for name in stack or list(config.stacks):
        result = lock_stack(root, config.stack(name), upgrade=upgrade, lanes=config.lanes_of_stack(name))
        print(result.render())


@task(
    help={
        "variant": "cu13, rocm720-mi35x or rocm720-mi30x (miles/image/images.toml)",
        "push": "push the dated tag and move the rolling alias to it",
        "dry": "print the plan and the buildx command; run nothing",
        "image": "registry path (default: images.toml's image, or $MILES_IMAGE)",
    }
)
def refresh_image(c, variant, push=False, dry=False, image=None):
    """Build the variant's image under a dated, input-hashed tag, unless one with those inputs exists."""
    import os
    from pathlib import Path

    from miles.image.plan import pins_problems, plan_refresh, refresh, write_github_output

    root = Path(__file__).resolve().parent
    plan = plan_refresh(root, variant, push=push, image=image or os.environ.get("MILES_IMAGE"))
    print(plan.render())
    if dry:
        problems = pins_problems(root, plan.variant)
        print(
            "pins        "
            + ("; ".join(map(str, problems)) if problems else "Dockerfile agrees with the lock")
        )
        return
    result = refresh(root, plan)
    print(result.message)
    write_github_output("tag", result.tag)  # the workflow's test jobs run in exactly this tag


@task(
    help={"tag": "an image tag <image>:<variant>-<YYYYMMDD>-<hash8>", "variant": "when the tag does not say"}
)
def check_image(c, tag, variant=None):
    """Run the image and diff its installed packages against its lane's lock (exit 1 on differences)."""
    from pathlib import Path

    from invoke import Exit

    from miles.image.plan import check_image as check

    result = check(Path(__file__).resolve().parent, tag, variant=variant)
    print(result.render())
    if not result.ok:
        raise Exit(code=1)
