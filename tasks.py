"""Operator chores: `invoke --list`. Each task is a thin shell over a miles function.

A task's error (an unknown variant or recipe, no docker, a package the task needs that is not
installed) ends it with one line and the exit code miles.exits gives it, never a traceback.
"""

from __future__ import annotations

import functools

from invoke import Exit
from invoke import task as invoke_task

from miles.families import names as family_names


def task(*args, **kwargs):
    """invoke's @task, with the task's errors ended as miles.exits describes them."""

    def decorate(body):
        @functools.wraps(body)
        def run(c, *a, **kw):
            from miles.exits import describe, quiet_broken_pipe

            try:
                return body(c, *a, **kw)
            except Exit:
                raise
            except BrokenPipeError:
                raise Exit(code=quiet_broken_pipe()) from None
            except Exception as exc:
                ended = describe(exc, f"invoke {body.__name__.replace('_', '-')}")
                if ended is None:
                    raise
                raise Exit(ended[0], code=ended[1]) from None

        return invoke_task(*args, **kwargs)(run)

    return decorate


@task(help={"strict": "exit non-zero on error-class findings"})
def audit(c, strict=False):
    """Print the CI audit: disabled tests and their age, coverage gaps, unused suites."""
    from miles.ci.cli import main

    code = main(["audit", *(["--strict"] if strict else [])])
    if code:
        raise Exit(code=code)


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
        "no_alias": "with --push: push only the dated tag, never moving the rolling alias (PR builds)",
        "dry": "print the plan and the buildx command; run nothing",
        "image": "registry path (default: images.toml's image, or $MILES_IMAGE)",
    }
)
def refresh_image(c, variant, push=False, dry=False, image=None, no_alias=False):
    """Build the variant's image under a dated, input-hashed tag, unless one with those inputs exists."""
    import os
    from pathlib import Path

    from invoke import Exit

    from miles.ci.registry.catalog import UnknownName
    from miles.ci.selection.policy import write_github_outputs
    from miles.image.plan import pins_problems, plan_refresh, refresh

    root = Path(__file__).resolve().parent
    try:
        plan = plan_refresh(
            root, variant, push=push, image=image or os.environ.get("MILES_IMAGE"), move_alias=not no_alias
        )
    except UnknownName as exc:  # a mistyped --variant: one line, exit 2
        raise Exit(f"error: --variant: {exc}", code=2) from None
    print(plan.render())
    if dry:
        problems = pins_problems(root, plan.variant)
        print(
            "pins        "
            + ("; ".join(map(str, problems)) if problems else "Dockerfile agrees with the lock")
        )
        print_transformer_engine(root, plan.variant)
        return
    result = refresh(root, plan)
    print(result.message)
    write_github_outputs({"tag": result.tag})  # the workflow's test jobs run in exactly this tag


def print_transformer_engine(root, variant) -> None:
    """refresh-image --dry: the variant's Transformer Engine and whether its statements agree."""
    from miles.image.te import te_problems, te_summary

    print("te          " + te_summary(root, variant))
    problems = te_problems(root, variant)
    print("te pins     " + ("; ".join(problems) if problems else "lock, Dockerfile and images.toml agree"))


@task(
    help={"tag": "an image tag <image>:<variant>-<YYYYMMDD>-<hash8>", "variant": "when the tag does not say"}
)
def check_image(c, tag, variant=None):
    """Run the image and diff its installed packages against its lane's lock (exit 1 on differences)."""
    from pathlib import Path

    from miles.image.plan import check_image as check

    result = check(Path(__file__).resolve().parent, tag, variant=variant)
    print(result.render())
    if not result.ok:
        raise Exit(code=1)


@task(
    help={
        "recipe": "recipe whose plan to run (python -m miles.recipes list)",
        "model": "model name: the recipe's model, an -Nlayer slice of it, or tiny",
        "steps": "run only these of the plan's steps, comma-separated (fetch,validate,trim,fp8,torch_dist,stage)",
        "platform": "recipe platform (cpu, cuda, rocm); default: this machine's",
        "dry": "print what each step would do; change nothing",
        "model_dir": "parent of the prepared dirs (default: the recipe's, or $MILES_MODEL_DIR)",
        "stage_dir": "node-local directory to stage the prepared dirs into",
        "source": "override the source: tiny:<family>, a local dir, or org/name[@revision]",
        "family": "without --recipe: the model family",
        "layers": "without --recipe: N of the N-layer slice",
        "scan_nan": "validate: share of every float tensor read for NaN/Inf (default 1: all; 0: headers only)",
        "data_dir": "with --recipe: where the fetch step puts the recipe's prompt datasets (default .miles/data)",
    }
)
def prepare_ckpt(
    c, model, recipe=None, steps=None, platform=None, dry=False, model_dir=None, stage_dir=None,
    source=None, family=None, layers=None, scan_nan=None, data_dir=None,
):  # fmt: skip
    """Prepare a model's checkpoints (fetch, validate, trim, FP8, torch_dist, stage) and its data; resumable."""
    from miles.ckpt.cli import main

    options = {
        "--recipe": recipe, "--platform": platform, "--steps": steps, "--model-dir": model_dir,
        "--stage-dir": stage_dir, "--source": source, "--family": family, "--layers": layers,
        "--scan-nan": scan_nan, "--data-dir": data_dir,
    }  # fmt: skip
    argv = ["prepare", "--model", model]
    argv += [str(x) for k, v in options.items() if v is not None for x in (k, v)]
    code = main(argv + (["--dry"] if dry or c.config.run.dry else []))
    if code:
        raise Exit(code=code)


@task(
    help={
        "family": "one of: " + ", ".join(family_names()),
        "layers": "number of decoder layers",
        "out": "directory to create",
        "seed": "random seed of the weights",
        "dim": "config override KEY=VALUE, repeatable (--dim hidden_size=2048, 0/1 for a switch: --dim tie_word_embeddings=0)",
        "shard_bytes": "largest shard size in bytes",
        "dry": "print what would be built; build nothing",
    },
    iterable=["dim"],
)
def make_tiny_ckpt(c, family, out, layers=4, seed=0, dim=None, shard_bytes=None, dry=False):
    """Build a tiny random checkpoint of a family's real architecture, with a local tokenizer."""
    from miles.ckpt.cli import main

    if family not in family_names():  # refused in one line, with --dry too
        raise Exit(f"error: --family {family!r} is not one of {', '.join(family_names())}", code=2)
    argv = ["make-tiny", "--family", family, "--layers", str(layers), "--out", out, "--seed", str(seed)]
    argv += [x for d in dim or [] for x in ("--dim", d)]
    argv += ["--shard-bytes", str(shard_bytes)] if shard_bytes else []
    if dry or c.config.run.dry:
        print("would run: python -m miles.ckpt " + " ".join(argv))
        return
    code = main(argv)
    if code:
        raise Exit(code=code)
