"""The CPU lane's wall time per phase, before and after a change, side by side.

    python benchmarks/bench_cpu_lane.py --before REV [--after REV] [--suite stage-b-cpu] [--keep DIR] [--together]
    python benchmarks/bench_cpu_lane.py --reports BEFORE_RUN_JSON AFTER_RUN_JSON

Each side is a revision exported clean (`git archive`; the after side defaults to this working
tree as it is), run with this interpreter as the lane runs it (`python -m miles.ci run --lane
cpu`, with --continue-on-error so every file is measured), one side after the other on the same
machine (or with --together both at once, so a shared machine's load falls on both alike), each
with its own report folder. Prints the lane's wall time and CPU seconds (of every process of the
side, however loaded the machine: the work it costs), its seconds per phase
(miles.ci.reports.phases: start-up and imports, checkpoints, initialisation, rollouts, steps,
teardown, other), the files whose time changed most, and the load average during each side (this
machine is shared: a side measured under more load is slower for that reason alone). A revision
from before the phase records shows elapsed times only. `--reports` prints the same comparison
from two `run.json` files already written, without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles.ci.reports.phases import COLUMNS, totals  # noqa: E402

TOP = 20


def export(rev: str, into: Path) -> Path:
    """The tree of `rev`, as `git archive` writes it, under `into`."""
    tree = into / rev.replace("/", "_")
    tree.mkdir(parents=True)
    archive = into / f"{tree.name}.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), rev], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    archive.unlink()
    return tree


class LoadSampler:
    """The 1-minute load average every few seconds while a side runs."""

    def __init__(self, every: float = 5.0):
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def describe(self) -> str:
        if not self.samples:
            return "load not sampled"
        mean = sum(self.samples) / len(self.samples)
        return f"load average mean {mean:.1f}, max {max(self.samples):.1f} on {os.cpu_count()} cores"


def start_lane(tree: Path, reports: Path, suites: list[str]) -> subprocess.Popen:
    """The cpu lane of `tree` started, its output in `<reports>.log`."""
    scope = ["--lane", "cpu", *(f"--suite={s}" for s in suites)]
    if suites and (tree / "miles/ci/running/jobs.py").is_file():
        scope += ["--jobs", "cores"]  # the suites as the lane runs them, where the lane has jobs
    cmd = [
        sys.executable,
        "-m",
        "miles.ci",
        "run",
        *scope,
        "--continue-on-error",
        "--report-dir",
        str(reports),
    ]
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the tree's miles, also in workers run as scripts
    log = open(reports.with_suffix(".log"), "w")
    return subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_cpu(proc: subprocess.Popen) -> float:
    """Wait for a side's runner; the CPU seconds of it and of every process below it."""
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0
    return usage.ru_utime + usage.ru_stime


def run_sides(
    trees: list[Path], keep: Path, suites: list[str], together: bool
) -> list[tuple[dict, str, float]]:
    """Each side's run.json, the load while it ran and its CPU seconds."""
    sides = ("before", "after")
    if together:
        with LoadSampler() as load:
            procs = [start_lane(tree, keep / side, suites) for side, tree in zip(sides, trees, strict=True)]
            cpus = [wait_cpu(p) for p in procs]
        return [(_read(keep / side), load.describe(), cpu) for side, cpu in zip(sides, cpus, strict=True)]
    out = []
    for side, tree in zip(sides, trees, strict=True):
        started = time.time()
        with LoadSampler() as load:
            cpu = wait_cpu(start_lane(tree, keep / side, suites))
        print(f"{side}: {tree} ran in {time.time() - started:.0f}s ({load.describe()})", flush=True)
        out.append((_read(keep / side), load.describe(), cpu))
    return out


def _read(reports: Path) -> dict:
    return json.loads((reports / "run.json").read_text())


def final_attempts(run: dict) -> dict[str, dict]:
    last: dict[str, dict] = {}
    for a in run["attempts"]:
        last[a["file"]] = a
    return last


def _ratio(before: float, after: float) -> str:
    return f"{after / before:.2f}x" if before > 0 else "-"


def compare(
    before: dict, after: dict, loads: tuple[str, str] = ("", ""), cpu: tuple[float, float] | None = None
) -> str:
    """The side-by-side table of two run.json records (and the sides' CPU seconds when measured)."""
    b, a = final_attempts(before), final_attempts(after)
    wall_b = before["finished_at"] - before["started_at"]
    wall_a = after["finished_at"] - after["started_at"]
    if cpu is None:  # the records' own, where their runner counted it
        cpu = tuple(sum(x.get("cpu", 0.0) for x in side.values()) for side in (b, a))
    out = [
        f"{'':<24}{'before':>12}{'after':>12}{'after/before':>14}",
        f"{'lane wall':<24}{wall_b:>11.0f}s{wall_a:>11.0f}s{_ratio(wall_b, wall_a):>14}",
        f"{'lane cpu':<24}{cpu[0]:>11.0f}s{cpu[1]:>11.0f}s{_ratio(cpu[0], cpu[1]):>14}",
        f"{'files':<24}{len(b):>12}{len(a):>12}",
        f"{'not passed':<24}{sum(x['status'] not in ('passed', 'flaky') for x in b.values()):>12}"
        f"{sum(x['status'] not in ('passed', 'flaky') for x in a.values()):>12}",
    ]
    phased_b = [x["phases"] for x in b.values() if x.get("phases")]
    phased_a = [x["phases"] for x in a.values() if x.get("phases")]
    if phased_b and phased_a:
        tb, ta = totals(phased_b), totals(phased_a)
        out += ["", "seconds per phase (summed over files):"]
        out += [f"  {c:<22}{tb[c]:>11.0f}s{ta[c]:>11.0f}s{_ratio(tb[c], ta[c]):>14}" for c in COLUMNS]
    else:
        out += ["", "(a side recorded no phases: that revision predates them; elapsed times only)"]
    changed = sorted(
        set(b) | set(a), key=lambda f: -abs(b.get(f, {}).get("elapsed", 0) - a.get(f, {}).get("elapsed", 0))
    )
    out += ["", f"files whose time changed most (seconds, top {TOP}):"]
    for f in changed[:TOP]:
        eb, ea = b.get(f, {}).get("elapsed"), a.get(f, {}).get("elapsed")
        shown_b = f"{eb:.0f}" if eb is not None else "-"
        shown_a = f"{ea:.0f}" if ea is not None else "-"
        out.append(f"  {shown_b:>6} {shown_a:>6}  {f}")
    if any(loads):
        out += ["", f"before: {loads[0]}", f"after:  {loads[1]}"]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="git revision measured first")
    parser.add_argument("--after", help="git revision measured second (default: this working tree)")
    parser.add_argument(
        "--suite", action="append", default=[], help="only this suite of the lane (repeatable)"
    )
    parser.add_argument("--keep", type=Path, help="folder for both sides' reports (default: a temp folder)")
    parser.add_argument(
        "--reports", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="two run.json files"
    )
    parser.add_argument(
        "--together", action="store_true", help="run both sides at once (the same machine load)"
    )
    args = parser.parse_args()
    if args.reports:
        before, after = (json.loads(p.read_text()) for p in args.reports)
        print(compare(before, after))
        return 0
    if not args.before:
        parser.error("give --before REV (or --reports BEFORE AFTER)")
    with tempfile.TemporaryDirectory(prefix="miles-bench-lane-") as tmp:
        keep = args.keep or Path(tmp)
        keep.mkdir(parents=True, exist_ok=True)
        # under --keep, the trees stay too: each holds the durations its run stored (.miles/)
        trees = [export(args.before, keep / "trees")]
        trees.append(export(args.after, keep / "trees") if args.after else ROOT)
        (before, load_b, cpu_b), (after, load_a, cpu_a) = run_sides(trees, keep, args.suite, args.together)
        print()
        print(compare(before, after, (load_b, load_a), (cpu_b, cpu_a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
