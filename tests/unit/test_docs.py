"""The README and docs/ against the code: the front door stays short and starts with the two
commands; every link, anchor and repository path they name exists; every version they quote
is one a lock pins; the numbers they quote are the code's (the table below names, for each,
the sentence it sits in and the constant it must equal)."""

from __future__ import annotations

import re
from pathlib import Path

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README, *PAGES]
LOCKS = sorted((ROOT / "requirements").glob("*.txt"))


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_readme_is_a_front_door():
    lines = _text(README).splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; move detail to a page under docs/"
    block = "\n".join(lines[:6])
    assert "python3 -m pip install nox && nox -s cpu" in block
    assert "python3 -m pip install nox && nox -s tests" in block


def test_every_page_is_linked_from_the_readme():
    readme = _text(README)
    missing = [_rel(p) for p in PAGES if f"]({_rel(p)})" not in readme]
    assert not missing, f"docs pages the README does not link: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m[1]) for m in re.finditer(r"^#+ (.+)$", _text(path), re.M)}


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _links():
    for doc in DOCS:
        for n, line in enumerate(_text(doc).splitlines(), 1):
            for target in _LINK.findall(line):
                if not re.match(r"[a-z]+:", target):
                    yield doc, n, target


def test_every_link_and_anchor_exists():
    broken = []
    for doc, n, target in _links():
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{_rel(doc)}:{n}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{_rel(doc)}:{n}: {target}: no heading with that anchor")
    assert not broken, "\n".join(broken)


# A path in backticks that starts at a top-level folder of the project.
_PATH = re.compile(r"`((?:miles|tests|scripts|benchmarks|requirements|docker|docs|\.github|\.ci)/[^`\s]*)`")


def test_every_repository_path_named_exists():
    missing = []
    for doc in DOCS:
        for n, line in enumerate(_text(doc).splitlines(), 1):
            for path in _PATH.findall(line):
                if re.search(r"[<>{}*…]|\.\.\.", path):
                    continue  # a pattern (`tests/snapshots/recipes/<name>.json`), not a path
                if not (ROOT / path).exists():
                    missing.append(f"{_rel(doc)}:{n}: {path}")
    assert not missing, "paths the docs name that do not exist:\n" + "\n".join(missing)


def _pins() -> dict[str, set[str]]:
    pins: dict[str, set[str]] = {}
    for lock in LOCKS:
        for line in _text(lock).splitlines():
            match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==(\S+)$", line.strip())
            if match:
                name = re.sub(r"[-_.]+", "-", match[1]).lower()
                pins.setdefault(name, set()).add(match[2])
    return pins


# Packages whose versions the docs quote as "<name> X.Y[.Z]" or "<name>==X.Y.Z".
_QUOTED = ("torch", "transformers", "megatron-core", "sglang", "numba", "transformer-engine")
_VERSION = re.compile(r"\b(" + "|".join(map(re.escape, _QUOTED)) + r")(?:==| )(\d+(?:\.\d+)+)\b")


def test_every_quoted_version_is_pinned():
    pins = _pins()
    wrong = []
    for doc in DOCS:
        for n, line in enumerate(_text(doc).splitlines(), 1):
            for name, version in _VERSION.findall(line):
                locked = {v.split("+")[0] for v in pins.get(name, ())}
                if not any(v == version or v.startswith(version + ".") for v in locked):
                    wrong.append(f"{_rel(doc)}:{n}: {name} {version}; the locks pin {sorted(locked)}")
    assert not wrong, "\n".join(wrong)


def test_the_lanes_table_is_the_catalogs():
    from miles.ci.registry.catalog import load_catalog

    catalog = load_catalog()
    table = _text(README).split("## Lanes", 1)[1].split("\n\n", 2)[1]
    named = set()
    for row in table.splitlines()[2:]:
        command = row.split("|")[1]
        for lane in re.findall(r"nox -s ([\w{},-]+)", command):
            if "{" in lane:  # nightly-mi350-{2,4,8}gpu
                stem, options, tail = re.match(r"(.*)\{(.*)\}(.*)", lane).groups()
                named |= {f"{stem}{o}{tail}" for o in options.split(",")}
            else:
                named.add(lane)
    assert named == set(catalog.lanes), "README's lane table differs from miles/ci/catalog.toml"


def _families_table() -> dict[str, list[str]]:
    """docs/megatron.md's table of model families: family -> its cells."""
    text = _text(ROOT / "docs/megatron.md")
    rows = [line for line in text.splitlines() if line.startswith("| `") and line.count("|") == 6]
    return {row.split("|")[1].strip().strip("`"): [c.strip() for c in row.split("|")[2:-1]] for row in rows}


def test_the_family_table_is_the_families_miles_finds():
    from miles.families import OwnModelFamily, families

    table = _families_table()
    assert sorted(table) == sorted(families()), "docs/megatron.md's family table lists other families"
    for name, family in families().items():
        types, kind, modules, limits = table[name]
        assert set(re.findall(r"`([^`]+)`", types)) == set(family.model_types), name
        assert kind == ("own model" if isinstance(family, OwnModelFamily) else "GPTModel"), name
        own = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "miles/families" / name).glob("*.py"))
        assert set(re.findall(r"`([^`]+)`", modules)) == {p for p in own if not p.endswith("__init__.py")}, (
            name
        )
        limits_of = family.limits({"o_groups": 8})
        assert ("no context parallelism" in limits) == bool(limits_of.context_parallel), name
        assert ("TP divides" in limits) == bool(limits_of.tp_divides), name


def _facts():
    """(page, the sentence with one number in a group, that number as the code has it)."""
    from miles.ci.machine import preflight
    from miles.ci.machine.device_check_train import TRAIN_TIMEOUT_S
    from miles.ci.registry.catalog import load_catalog
    from miles.ci.running import plan
    from miles.ckpt import fp8, fp8_rules
    from miles.exits import EXIT_BROKEN_PIPE
    from miles.megatron import compat, proof
    from miles.metrics import gate, store
    from miles.train import algorithm
    from miles.train.checks import STEP_TOL
    from miles.train.config import JobConfig, OptimizerConfig

    implicit = load_catalog().implicit["tests/unit"]
    return [
        ("README.md", r"ends the\s+command quietly with (\d+)", EXIT_BROKEN_PIPE),
        ("docs/ci.md", r"`--timeout-floor`, default (\d+) s", plan.DEFAULT_TIMEOUT_FLOOR),
        ("docs/ci.md", r"`max\(floor, ([\d.]+) × est_time\)`", plan.TIMEOUT_FACTOR),
        ("docs/ci.md", r"`--grace` at most (\d+) s", plan.MAX_GRACE),
        ("docs/ci.md", r"\((\d+) GiB on GPU lanes", preflight.MIN_FREE_GB["cuda"]),
        ("docs/ci.md", r"\(`tests/unit/`:\s+`stage-a-cpu`, (\d+) s", implicit.est_time),
        ("docs/metrics-gates.md", r"median of the last K=(\d+)", gate.GatePolicy().k),
        ("docs/metrics-gates.md", r"fewer than (\d+) trusted values", gate.GatePolicy().min_history),
        ("docs/metrics-gates.md", r"\(([\d.]+)·MAD\)", gate.MAD_TO_SIGMA),
        (
            "docs/metrics-gates.md",
            r"`MILES_HISTORY_TIMEOUT` seconds\s+\(default (\d+)",
            store.DEFAULT_TIMEOUT_S,
        ),
        ("docs/checkpoints.md", r"(\d+)x\d+ tiles in `float8_e4m3fn`", fp8_rules.BLOCK),
        ("docs/checkpoints.md", r"amax/(\d+) per", fp8.E4M3_MAX),
        ("docs/layouts.md", r"\(at most (\d+);", proof.MAX_RANKS),
        ("docs/training.md", r"`--max-skipped-steps N` \(default (\d+)", OptimizerConfig().max_skipped_steps),
        ("docs/training.md", r"clamped to \[-(\d+), \d+\]", algorithm.LOG_RATIO_LIMIT),
        ("docs/training.md", r"has not ended after (\d+) s fails", TRAIN_TIMEOUT_S),
        (
            "docs/training.md",
            r"`--offload-train-disk-chunk-mb`\s+\(default (\d+)\)",
            JobConfig().offload_train_disk_chunk_mb,
        ),
        ("docs/training.md", r"the seed's bound of (\d+)% \(rel and abs\)", STEP_TOL * 100),
        ("docs/megatron.md", r"- (\d+) redirects \(`REDIRECTS`\)", len(compat.REDIRECTS)),
        ("docs/megatron.md", r"- (\d+) patches \(`PATCHES`\)", len(compat.PATCHES)),
        ("docs/megatron.md", r"- (\d+) names megatron-core binds only", len(compat.MISSING_SYMBOLS)),
        ("docs/megatron.md", r"`KNOWN_RELEASE`\s+\(([\d.]+)\)", compat.KNOWN_RELEASE),
        ("docs/megatron.md", r"Every lane pins megatron-core ([\d.]+)", compat.KNOWN_RELEASE),
    ]


def test_the_numbers_the_docs_quote_are_the_codes():
    wrong = []
    for page, pattern, value in _facts():
        found = re.findall(pattern, _text(ROOT / page))
        if not found:
            wrong.append(f"{page}: the sentence /{pattern}/ is gone; update this table with the page")
        for quoted in found:
            same = quoted == value if isinstance(value, str) else float(quoted) == float(value)
            if not same:
                wrong.append(f"{page}: /{pattern}/ quotes {quoted}, the code says {value}")
    assert not wrong, "\n".join(wrong)


def test_the_default_bands_the_gates_page_lists_are_specs():
    from miles.metrics.spec import DEFAULT_BANDS, GENERIC_BAND

    text = " ".join(_text(ROOT / "docs/metrics-gates.md").split())
    listed = text.split("as rel/abs_floor up, then down:", 1)[1].split("A declared", 1)[0]
    quoted = {
        metric: tuple(map(float, nums))
        for metric, *nums in re.findall(r"`([\w/]+)`\s+([\d.]+)/([\d.]+), ([\d.]+)/([\d.]+)", listed)
    }
    expected = {m: (b.rel_up, b.abs_floor_up, b.rel_down, b.abs_floor_down) for m, b in DEFAULT_BANDS.items()}
    assert quoted == expected
    generic = re.search(r"any other metric ([\d.]+)/([\d.]+) both ways", listed)
    assert generic and (float(generic[1]), float(generic[2])) == (
        GENERIC_BAND.rel_up,
        GENERIC_BAND.abs_floor_up,
    )
    assert (GENERIC_BAND.rel_up, GENERIC_BAND.abs_floor_up) == (
        GENERIC_BAND.rel_down,
        GENERIC_BAND.abs_floor_down,
    )
