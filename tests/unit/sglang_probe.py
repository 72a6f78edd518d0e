"""Answers questions about the installed sglang in a process of its own, as JSON on stdout.

    python tests/unit/sglang_probe.py '<json list of cases>'
    python tests/unit/sglang_probe.py --fields      # ServerArgs' field names, one a line


Each case is {"argv": [...trainer flags...], "rank": r, "local_rank": l, "local_world": n}: the
probe parses the flags with miles, builds the engine's keyword arguments against the real
`sglang.srt.server_args.ServerArgs`, constructs a real ServerArgs from them (construction
does not resolve anything or touch a GPU) and reports what it holds.

A process of its own because importing sglang patches transformers (sglang's
hf_transformers_patches) and must not leak into other tests. sglang.srt.utils imports
triton at module load; triton compiles GPU kernels and the cpu lane does not install it
(its wheel is ~250 MB, and megatron-core changes code paths when it finds one). Where triton
is absent the probe gives sglang the import-only stand-ins of tests/unit/sglang_imports.py;
nothing read here runs a kernel.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the project root on the path, as the tests have it
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.unit.sglang_imports import install as _import_sglang


def fields() -> str:
    """The installed sglang's ServerArgs field names (miles/recipes/stacks/sglang-<version>-serverargs.txt)."""
    _import_sglang()
    from importlib.metadata import version

    import msgspec
    from sglang.srt.server_args import ServerArgs

    names = [f.name for f in msgspec.structs.fields(ServerArgs)]
    header = f"# sglang {version('sglang')}: msgspec.structs.fields(sglang.srt.server_args.ServerArgs)"
    return "\n".join([header, *names]) + "\n"


def _named(value):
    """A value as JSON holds it: a function (sglang's custom_sigquit_handler) by its dotted name."""
    return f"{value.__module__}.{value.__qualname__}" if callable(value) else value


def main(cases: list[dict]) -> list[dict]:
    _import_sglang()
    import msgspec
    from sglang.srt.server_args import ServerArgs

    from miles.train.args import parse_config
    from miles.train.distributed import DistInfo
    from miles.train.sglang_engine import SGLangUnavailable, server_kwargs

    answers = []
    for case in cases:
        config = parse_config(case["argv"])
        dist = DistInfo(
            rank=case.get("rank", 0),
            world_size=case.get("local_world", 1),
            local_rank=case.get("local_rank", 0),
            device=f"cuda:{case.get('local_rank', 0)}",
            backend="nccl",
        )
        try:
            kwargs = server_kwargs(
                config.sglang,
                dist,
                ServerArgs,
                model_path=config.checkpoint.hf_checkpoint,
                seed=config.rollout.rollout_seed,
                local_world_size=case.get("local_world", 1),
            )
        except SGLangUnavailable as exc:
            answers.append({"error": str(exc)})
            continue
        built = ServerArgs(**kwargs)
        answers.append(
            {
                "kwargs": {k: _named(v) for k, v in kwargs.items()},
                "built": {k: _named(getattr(built, k)) for k in kwargs},
                "types": {k: type(getattr(built, k)).__name__ for k in kwargs},
                "is_msgspec_struct": issubclass(ServerArgs, msgspec.Struct),
                "rollout_seed": config.rollout.rollout_seed,
            }
        )
    return answers


if __name__ == "__main__":
    if sys.argv[1:] == ["--fields"]:
        sys.stdout.write(fields())
    else:
        print(json.dumps(main(json.loads(sys.argv[1]))))
