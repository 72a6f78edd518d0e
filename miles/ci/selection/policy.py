"""What a CI event asks for: the cadence, the PR labels that widen a run, and whether the
run may store trusted metric history.

What runs (CPU tests always run):
- a push to main (merged code) and a schedule run every GPU test of their lanes: the policy
  gives them `run-ci-all`, so after a merge every GPU lane runs;
- a pull request runs the GPU tests whose labels its `run-ci-<label>` labels name
  (`run-ci-all`: every one); an unlabeled pull request runs no GPU test, only the CPU lane;
- a manual dispatch runs like a pull request, at the cadence its caller chose (a nightly or
  weekly cadence admits every GPU test).

History (the baselines every later run is gated against) is stored by one rule,
`stores_history`: only a run of merged code at a cadence that writes baselines: a schedule,
or a dispatch on main of a scheduled workflow (the catalog's [schedules]). A push to main
runs at the regular cadence and is gated against those baselines but stores nothing. The
rule reads the event, never a label: a PR with the `nightly` label runs the nightly tests but
stores nothing. Every suite's baselines come from the scheduled workflows that run it.

PR labels end up in shell commands (workflow steps pass them to `--labels`), so only names
that cannot carry shell syntax pass: `run-ci-<name>` with `<name>` made of letters, digits,
`_`, `.` and `-` (and starting with a letter or digit), plus `nightly` and
`bypass-fastfail`. `run-ci-<name>` must name a catalog label or `all`. Anything else given
to the runner is refused with a message; a PR's unrelated labels (`bug`, `documentation`)
are ignored by `python -m miles.ci policy`, which reads every label the PR has.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from miles.ci.registry.catalog import CADENCES, Catalog
from miles.metrics.store import BASELINE_CADENCES

LABEL_PREFIX = "run-ci-"
SAFE_LABEL = re.compile(r"run-ci-[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
BROAD_LABEL = "run-ci-all"
NIGHTLY_LABEL = "nightly"
BYPASS_FASTFAIL_LABEL = "bypass-fastfail"
SPECIAL_LABELS = (NIGHTLY_LABEL, BYPASS_FASTFAIL_LABEL)

# GitHub event name -> cadence. workflow_dispatch takes the cadence its caller chose.
EVENT_CADENCE = {
    "pull_request": "regular",
    "pull_request_target": "regular",
    "merge_group": "regular",
    "push": "regular",
    "workflow_dispatch": "regular",
    "schedule": "nightly",
    "release": "release",
}


# Events of merged code that run every GPU test (the workflows trigger `push` on main only).
EVERY_LABEL_EVENTS = ("push", "schedule")

MAIN_REF = "refs/heads/main"
# Events whose code is already on the main line; anything else (pull_request,
# pull_request_target, merge_group, release, ...) runs code that was not merged there.
MAIN_LINE_EVENTS = ("schedule", "push", "workflow_dispatch")


class PolicyError(ValueError):
    """A label, event or cadence the policy refuses; one line for the person who sent it."""


@dataclass(frozen=True)
class LabelSet:
    """The CI labels of a run, validated."""

    raw: tuple[str, ...]  # as given, in order, without duplicates
    domains: frozenset[str]  # catalog labels requested with run-ci-<label>
    all: bool = False  # run-ci-all
    nightly: bool = False
    bypass_fastfail: bool = False

    def admits(self, labels: Iterable[str]) -> bool:
        """True when this set requests any of `labels` (or everything)."""
        return self.all or bool(self.domains.intersection(labels))

    def __str__(self) -> str:
        return " ".join(self.raw) if self.raw else "(none)"


def split_labels(text: str) -> list[str]:
    """Labels from a string separated by commas and/or whitespace."""
    return [part for part in re.split(r"[\s,]+", text.strip()) if part]


def check_label(label: str, catalog: Catalog) -> str:
    """`label` if it is a safe, known CI label; raises PolicyError saying why not."""
    if label in SPECIAL_LABELS or label == BROAD_LABEL:
        return label
    if not SAFE_LABEL.match(label):
        shown = label if len(label) <= 60 else label[:57] + "..."
        raise PolicyError(
            f"label {shown!r} is refused: CI labels must be run-ci-<name> (letters, digits, '_', '.', '-'), "
            f"'{NIGHTLY_LABEL}' or '{BYPASS_FASTFAIL_LABEL}', because labels are passed to shell commands"
        )
    domain = label[len(LABEL_PREFIX) :]
    if domain not in catalog.labels:
        known = ", ".join(f"{LABEL_PREFIX}{name}" for name in [*catalog.labels, "all"])
        raise PolicyError(f"label '{label}' names no catalog label; known: {known}")
    return label


def parse_labels(labels: str | Iterable[str], catalog: Catalog) -> LabelSet:
    """Validate CI labels (a string or a list) into a LabelSet; raises PolicyError."""
    items = split_labels(labels) if isinstance(labels, str) else [str(x).strip() for x in labels]
    seen: list[str] = []
    for label in items:
        if label and label not in seen:
            seen.append(check_label(label, catalog))
    domains = frozenset(
        x[len(LABEL_PREFIX) :] for x in seen if x.startswith(LABEL_PREFIX) and x != BROAD_LABEL
    )
    return LabelSet(
        raw=tuple(seen),
        domains=domains,
        all=BROAD_LABEL in seen,
        nightly=NIGHTLY_LABEL in seen,
        bypass_fastfail=BYPASS_FASTFAIL_LABEL in seen,
    )


def check_cadence(cadence: str) -> str:
    if cadence not in CADENCES:
        raise PolicyError(f"cadence '{cadence}' is not one of {', '.join(CADENCES)}")
    return cadence


def effective_cadence(cadence: str, labels: LabelSet | None) -> str:
    """A `nightly` label turns a regular run into a nightly one (admits nightly tests)."""
    if labels is not None and labels.nightly and cadence == "regular":
        return "nightly"
    return cadence


@dataclass(frozen=True)
class CiEvent:
    """The GitHub event a run belongs to, as the Actions environment names it."""

    name: str  # GITHUB_EVENT_NAME
    ref: str  # GITHUB_REF
    workflow: str  # GITHUB_WORKFLOW_REF: owner/repo/.github/workflows/<file>@<ref>

    @property
    def workflow_file(self) -> str:
        return self.workflow.split("@", 1)[0].rsplit("/", 1)[-1]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> CiEvent | None:
        """The event of a run under GitHub Actions; None outside it (a person at a terminal)."""
        if env.get("GITHUB_ACTIONS") != "true":
            return None
        return cls(
            env.get("GITHUB_EVENT_NAME", ""), env.get("GITHUB_REF", ""), env.get("GITHUB_WORKFLOW_REF", "")
        )


def baseline_workflows(catalog: Catalog) -> frozenset[str]:
    """Workflow files whose scheduled runs write baselines (the catalog's [schedules] at a
    nightly or weekly cadence)."""
    return frozenset(name for name, cadence in catalog.schedules.items() if cadence in BASELINE_CADENCES)


def history_decision(event: CiEvent | None, cadence: str, catalog: Catalog) -> tuple[bool, str]:
    """(whether the run stores trusted history, why); `cadence` is the one the event or the
    person chose, never one a label widened. See the module docstring for the rule."""
    if cadence not in BASELINE_CADENCES:
        return False, f"cadence '{cadence}' writes no baselines: only nightly or weekly runs write baselines"
    if event is None:
        return True, f"a {cadence} run outside CI"
    if event.name not in MAIN_LINE_EVENTS:
        return False, f"a {event.name or 'run of an unknown event'} run never stores history"
    if event.ref != MAIN_REF:
        return False, f"a {event.name} run on {event.ref or 'an unknown ref'} is not on {MAIN_REF}"
    if event.name == "workflow_dispatch" and event.workflow_file not in baseline_workflows(catalog):
        writers = ", ".join(sorted(baseline_workflows(catalog))) or "none"
        return (
            False,
            f"a dispatch of {event.workflow_file or 'an unknown workflow'} (baseline workflows: {writers})",
        )
    return True, f"a {cadence} {event.name} run on {MAIN_REF}"


def stores_history(event: CiEvent | None, cadence: str, catalog: Catalog) -> bool:
    """The one rule for storing trusted metric history (see history_decision)."""
    return history_decision(event, cadence, catalog)[0]


@dataclass(frozen=True)
class Policy:
    """What a workflow passes on to the runner for one event."""

    event: str
    cadence: str
    labels: LabelSet
    ignored: tuple[str, ...]  # PR labels that are not CI labels
    store_history: bool = False  # stores_history() of the event at its own cadence

    @property
    def continue_on_error(self) -> bool:
        return self.labels.bypass_fastfail

    def gpu_scope(self) -> str:
        """Which GPU tests this event runs, in words (CPU tests always run)."""
        if self.labels.all or self.cadence != "regular":
            why = (
                "merged code" if self.event in EVERY_LABEL_EVENTS else f"{self.cadence} cadence or run-ci-all"
            )
            return f"every GPU test ({why})"
        if self.labels.domains:
            return "the GPU tests labelled " + ", ".join(sorted(self.labels.domains))
        return "no GPU test, only the CPU lane: add run-ci-<label> (or run-ci-all) to run GPU tests"

    def outputs(self) -> dict[str, str]:
        """GitHub step outputs; every value is safe to paste into a shell command."""
        return {
            "cadence": self.cadence,
            "labels": " ".join(self.labels.raw),
            "continue_on_error": "true" if self.continue_on_error else "false",
            "run_all": "true" if self.labels.all or self.cadence != "regular" else "false",
            "store_history": "true" if self.store_history else "false",
        }


def labels_from_json(text: str) -> list[str]:
    """PR label names from JSON: a list of names, or of objects with a `name` (as in
    `toJSON(github.event.pull_request.labels)`); empty text means no labels."""
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PolicyError(f"--labels-json is not valid JSON ({exc.msg} at char {exc.pos})") from None
    if data is None:
        return []
    if not isinstance(data, list):
        raise PolicyError('--labels-json must be a JSON list of label names or of {"name": ...} objects')
    names = []
    for item in data:
        name = item.get("name") if isinstance(item, dict) else item
        if not isinstance(name, str):
            raise PolicyError(f"--labels-json: {item!r} is neither a label name nor an object with a name")
        names.append(name)
    return names


def resolve_policy(
    event: str,
    pr_labels: Iterable[str],
    catalog: Catalog,
    *,
    cadence: str | None = None,
    ref: str = "",
    workflow: str = "",
) -> Policy:
    """Cadence, CI labels and history storage for a GitHub event. `cadence` is the choice of a
    manually dispatched run; a `nightly` label makes a PR run nightly-cadence tests too, but
    storing history is decided from the event alone."""
    if event not in EVENT_CADENCE:
        raise PolicyError(f"event '{event}' is not one of {', '.join(EVENT_CADENCE)}")
    if cadence is not None:
        check_cadence(cadence)
        if event != "workflow_dispatch" and cadence != EVENT_CADENCE[event]:
            raise PolicyError(
                f"--cadence applies to workflow_dispatch only; {event} runs {EVENT_CADENCE[event]}"
            )
    ci, ignored = [], []
    for name in pr_labels:
        (ci if name.startswith(LABEL_PREFIX) or name in SPECIAL_LABELS else ignored).append(name)
    if event in EVERY_LABEL_EVENTS:  # merged code: every GPU lane runs
        ci.append(BROAD_LABEL)
    labels = parse_labels(ci, catalog)
    base = cadence or EVENT_CADENCE[event]
    store = stores_history(CiEvent(event, ref, workflow), base, catalog)
    return Policy(
        event=event,
        cadence=effective_cadence(base, labels),
        labels=labels,
        ignored=tuple(ignored),
        store_history=store,
    )


def write_github_outputs(outputs: dict[str, str], path: str | None = None) -> str | None:
    """Append `key=value` lines to $GITHUB_OUTPUT (or `path`); returns the file written."""
    target = path or os.environ.get("GITHUB_OUTPUT")
    if not target:
        return None
    with open(target, "a", encoding="utf-8") as fh:
        for key, value in outputs.items():
            if "\n" in value:
                raise PolicyError(f"output {key} contains a newline; refusing to write it")
            fh.write(f"{key}={value}\n")
    return target
