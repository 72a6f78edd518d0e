"""Several trainer commands in one launch of the ranks: the trainer's own loop, one command after another.

    python -m torch.distributed.run --nproc-per-node 2 tests/support/trainer_cases.py CASES_JSON OUT_DIR

For each case {name: [miles.train flags]} the ranks do what `python -m miles.train FLAGS` does
between its start and its shutdown (parse_config, build_run, train: the same functions, so the
same backends, layouts, checks and metrics) with the case's metric records in OUT_DIR/<name>;
the process group and the imports are made once for all of them, and megatron-core's parallel
state is rebuilt by each case's backend for its own layout. `run_cases` is the launch for tests.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def run_cases(cases: Mapping[str, Sequence[str]], out: Path, *, nproc: int = 2) -> dict[str, Path]:
    """Run every case in one launch of `nproc` ranks; the metric record folder of each case."""
    from tests.support import ranks

    out.mkdir(parents=True, exist_ok=True)
    ranks.succeeded(
        ranks.launch(Path(__file__), json.dumps({k: list(v) for k, v in cases.items()}), out, nproc=nproc)
    )
    return {name: out / name for name in cases}


def main() -> None:
    from miles.metrics.capture import RECORD_DIR_ENV
    from miles.train.args import parse_config
    from miles.train.distributed import shutdown
    from miles.train.runtime import build_run
    from miles.train.trainer import train

    cases, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    try:
        for name, argv in cases.items():
            os.environ[RECORD_DIR_ENV] = str(out / name)
            train(build_run(parse_config(argv)))
    finally:
        shutdown()


if __name__ == "__main__":
    from miles.train.distributed import exit_process

    main()
    exit_process(0)
