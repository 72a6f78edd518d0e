"""The runner's memory when a test prints one huge line, against the same bytes in short lines.

    python benchmarks/bench_runner_output.py [--mb 200]

Two one-test projects print the same number of bytes: one as a single line, one as 80-byte
lines. Each is run by `python -m miles.ci run` under a small wrapper that reports the peak
resident memory of the runner's process tree (RUSAGE_CHILDREN, the largest of them; pytest
runs with -s so that its own capture does not hold the output). The runner keeps only the
last bytes of the output, read in chunks, so the ratio should stay near 1; a runner that
reads whole lines holds the whole line, several times over.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = """
import sys
from miles.ci.register import register_cpu_ci
register_cpu_ci(est_time=60, suite="stage-b-cpu")
def test_prints():
    line = b"x" * ({width} - 1) + b"\\n" if {width} else b"x" * (1 << 20)
    for _ in range({count}):
        sys.stdout.buffer.write(line)
    sys.stdout.flush()
"""
WRAPPER = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def peak_kib(project: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(project / "cache")}
    env = {k: v for k, v in env.items() if not k.startswith("GITHUB_")}
    argv = [sys.executable, "-c", WRAPPER, sys.executable, "-m", "miles.ci", "run", "--root", str(project),
            "--suite", "stage-b-cpu", "--no-stream", "--pytest-arg=-s"]  # fmt: skip
    return int(subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="bytes the test prints, in MiB")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, width in (("one line", 0), ("80-byte lines", 80)):
            project = Path(tmp) / name.replace(" ", "-")
            (project / "tests" / "e2e").mkdir(parents=True)
            count = args.mb if width == 0 else (args.mb << 20) // width
            source = textwrap.dedent(TEST.format(width=width, count=count))
            (project / "tests" / "e2e" / "test_prints.py").write_text(source)
            results[name] = peak_kib(project)
    for name, kib in results.items():
        print(f"{name:>14}: peak RSS {kib / 1024:7.1f} MiB  ({args.mb} MiB printed)")
    print(f"ratio one line / short lines: {results['one line'] / results['80-byte lines']:.2f}")


if __name__ == "__main__":
    main()
