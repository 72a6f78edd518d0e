"""`references --check` reads a launcher from a mirror someone else controls: a crafted one ends
in one line naming the bound it broke, never a hang, a crash or a machine out of memory.

The issue's cases (a loop, a huge power, a catastrophic regex, unbounded recursion, list
growth), each a launcher committed on `main` of a small git repository and read by the
function `python -m miles.recipes references --check --mirror PATH` runs for each reading
(miles.recipes.reread.reread_one), in a child process with a timeout and a 3 GiB address-space
limit, so a reading that does not end, or grows without bound, fails its test instead of
hanging the suite or filling the machine's memory. More of their kind run the same evaluator
on the same launcher text in this process, under the same bounds.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=5, suite="stage-a-cpu")

SCRIPT = """
import json
import re
from dataclasses import dataclass


@dataclass
class ScriptArgs:
    n: int = 1


def execute(args: ScriptArgs):
{body}
"""

READ = """
import json, sys
from miles.recipes.fidelity import Reference
from miles.recipes.reread import reread_one
from miles.recipes.upstream import Mirror, Upstream
repo, commit = sys.argv[1], sys.argv[2]
source = Upstream("scripts/run_evil.py", commit, "execute", (), "8 H100s", nvlink=True)
finding = reread_one(Mirror(repo), "evil", Reference("cuda", "Evil", source, (), ()), "main")
print(json.dumps(finding.problems))
"""


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()  # fmt: skip


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def read(tmp_path: Path, body: str, *, script: str | None = None) -> str:
    """The one problem the check reports for a launcher whose `execute` body is `body`."""
    repo = tmp_path / "mirror"
    path = repo / "scripts" / "run_evil.py"
    path.parent.mkdir(parents=True)
    text = (
        script if script is not None else SCRIPT.format(body=textwrap.indent(textwrap.dedent(body), "    "))
    )
    path.write_text(text)
    _git(tmp_path, "init", "-q", "-b", "main", str(repo))
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "crafted")
    done = subprocess.run(
        [sys.executable, "-c", READ, str(repo), _git(repo, "rev-parse", "HEAD")],
        capture_output=True, text=True, timeout=240, check=False, preexec_fn=_limit_memory,
    )  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    (problem,) = json.loads(done.stdout)
    assert problem.startswith("cannot read the launcher: ") and "\n" not in problem, problem
    return problem


# --- the cases ----------------------------------------------------------------------


def test_a_loop_runs_out_of_steps(tmp_path):
    problem = read(tmp_path, "for i in range(100000):\n    for j in range(100000):\n        pass\n")
    assert re.search(r"scripts/run_evil.py:\d+: the read code ran past 200000 steps", problem), problem


def test_a_huge_power_is_refused_before_it_is_computed(tmp_path):
    problem = read(tmp_path, "x = 10 ** 10 ** 10\n")
    assert re.search(
        r"scripts/run_evil.py:\d+: 10 \*\* 10000000000 would pass the bound of 100000 bits", problem
    ), problem


def test_a_catastrophic_regex_is_refused_before_it_runs(tmp_path):
    problem = read(tmp_path, 're.match(r"(a+)+$", "a" * 40 + "b")\n')
    assert "regular expression '(a+)+$' repeats a repetition or an alternation" in problem, problem


def test_unbounded_recursion_stops_at_the_depth_bound(tmp_path):
    script = SCRIPT.format(body="    f(0)\n") + "\n\ndef f(n):\n    return f(n + 1)\n"
    problem = read(tmp_path, "", script=script)
    assert "f() calls nested 50 deep (unbounded recursion)" in problem, problem


def test_a_list_that_grows_itself_stops_at_the_size_bound(tmp_path):
    problem = read(tmp_path, "xs = [0]\nfor _ in range(40):\n    xs.extend(xs)\n")
    assert "growing a container past the bound of 1000000" in problem, problem


# --- more of the same kind ------------------------------------------------------------------


def evaluate(body: str, *, extra: str = "") -> str:
    """The BoundExceeded (or other one-line SourceError) of running a launcher's `execute` body
    with the evaluator in this process, as one reading (the bounds are the defaults)."""
    import json as _json
    import re as _re

    from miles.recipes.pysource import Evaluator, Namespace, SourceError, parse

    natives = {"re": Namespace("re", {n: getattr(_re, n) for n in ("search", "match", "fullmatch", "sub")}),
               "json": Namespace("json", {"loads": _json.loads})}  # fmt: skip
    text = SCRIPT.format(body=textwrap.indent(textwrap.dedent(body), "    ")) + extra
    evaluator = Evaluator(lambda name: natives[name])
    with pytest.raises(SourceError) as info, evaluator.bounded("scripts/run_evil.py"):
        module = parse("scripts/run_evil.py", text)
        evaluator.call(evaluator.lookup(module, "execute", module.tree), [None], {})
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ('s = "a" * 10 ** 12\n', "repeating 1 elements 1000000000000 times"),
        ("xs = [0] * 10 ** 12\n", "repeating 1 elements 1000000000000 times"),
        ("xs = [0]\nfor _ in range(30):\n    xs = xs + xs\n", "a value of 1048576 elements"),
        ("x = 2 ** 60\nfor _ in range(30):\n    x = x * x\n", "a product past the bound of 100000 bits"),
        ('s = f"{1:>1000000000}"\n', "a format width of 1000000000"),
        ('s = "%1000000000d" % 1\n', "a format width of 1000000000"),
        ('s = "{:>1000000000}".format(1)\n', "a format width of 1000000000"),
        ('s = ("a" * 1000).replace("a", "b" * 10000)\n', "replacing would make a string past the bound"),
        ('s = "x".join(["a" * 1000] * 2000)\n', "joining would make a string of 2001999"),
        ('s = re.sub("", "x" * 10000, "a" * 1000)\n', "re.sub could make a string past the bound"),
        ("d = dict.fromkeys(range(10 ** 9))\n", "a value of 1000000000 elements"),
        ("t = sum(range(10 ** 12))\n", "a value of 1000000000000 elements"),
        ('re.search(r"(a|aa)*c", "a" * 40)\n', "repeats a repetition or an alternation"),
        ('re.fullmatch(r"(?:x+)*y", "x" * 40)\n', "repeats a repetition or an alternation"),
    ],
)
def test_growth_past_the_bounds_is_refused(body, said):
    problem = evaluate(body)
    assert said in problem, problem


def test_mutual_recursion_stops_at_the_depth_bound():
    extra = "\n\ndef f(n):\n    return g(n)\n\n\ndef g(n):\n    return f(n)\n"
    assert "calls nested 50 deep" in evaluate("f(0)\n", extra=extra)


def test_deep_json_in_the_read_code_is_a_refusal_not_a_crash():
    problem = evaluate('json.loads("[" * 200000 + "]" * 200000)\n')
    assert "RecursionError" in problem, problem


def test_an_expression_nested_past_the_parser_is_one_line():
    problem = evaluate("x = " + "-" * 200_000 + "1\n")
    assert "scripts/run_evil.py" in problem and ("not Python" in problem or "nested too deeply" in problem), (
        problem
    )


def test_a_nul_byte_in_the_source_is_one_line():
    problem = evaluate("x = 1\n", extra="\0\n")
    assert "scripts/run_evil.py" in problem and "not Python" in problem, problem


def test_the_time_bound_stops_a_reading_that_stays_inside_the_others():
    """Steps and sizes set out of reach: the time bound alone stops the loop (a slower machine
    stops it sooner; the test asserts the message, never a duration)."""
    from miles.recipes.pysource import BoundExceeded, Bounds, Evaluator, parse

    module = parse(
        "scripts/x.py",
        "def f():\n    for i in range(10 ** 6):\n        for j in range(10 ** 6):\n            pass\n",
    )
    evaluator = Evaluator(
        lambda name: pytest.fail(f"nothing is imported, not {name}"), Bounds(steps=10**15, seconds=0.5)
    )
    with (
        pytest.raises(BoundExceeded, match=r"^scripts/x.py:\d+: the reading ran past 0.5 s"),
        evaluator.bounded("x"),
    ):
        evaluator.call(evaluator.lookup(module, "f", module.tree), [], {})


def test_the_time_bound_interrupts_a_native_call():
    """A native call that runs long (here a regex the static rule lets through, on a large input)
    is interrupted by the reading's alarm."""
    from miles.recipes.pysource import BoundExceeded, Bounds, Evaluator, Namespace, parse

    natives = {"re": Namespace("re", {"search": re.search})}
    module = parse("scripts/x.py", 'def f():\n    return re.search(r"a*b", "a" * 900000)\n', natives)
    evaluator = Evaluator(lambda name: pytest.fail(name), Bounds(seconds=0.2))
    with pytest.raises(BoundExceeded, match="the reading ran past 0.2 s"), evaluator.bounded("scripts/x.py"):
        evaluator.call(evaluator.lookup(module, "f", module.tree), [], {})
