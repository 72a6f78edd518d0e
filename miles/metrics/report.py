"""Rows of the stored history, for `history show` (text or JSON) and the plot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles.metrics.capture import encode_value
from miles.metrics.spec import LAST_STEP
from miles.metrics.store import HistoryStore, MetricValue, StoredRun
from miles.text import printable


@dataclass(frozen=True)
class HistoryRow:
    """One stored value of one run, with the run it belongs to."""

    run: StoredRun
    value: MetricValue

    @property
    def group(self) -> tuple[str, str]:
        return self.run.backend, self.run.suite

    def to_json(self) -> dict:
        c, v, r = self.value.coordinate, self.value, self.run
        return {
            "run": r.id,
            "created_at": r.created_at.isoformat(),
            "backend": r.backend,
            "suite": r.suite,
            "lane": r.lane,
            "cadence": r.cadence,
            "commit": r.commit,
            "pr": r.pr,
            "ci_run_id": r.ci_run_id,
            "trusted": r.trusted,
            "untrusted_reason": r.untrusted_reason,
            "metric": c.metric,
            "steps": c.steps_key,
            "constraint": c.constraint_key,
            "step": "last" if c.step == LAST_STEP else c.step,
            "value": encode_value(v.value),
            "ref": v.ref,
            "low": v.low,
            "high": v.high,
            "verdict": v.verdict,
        }


def history_rows(
    store: HistoryStore,
    test: str,
    *,
    backend: str | None = None,
    suite: str | None = None,
    metric: str | None = None,
    limit: int | None = 20,
) -> list[HistoryRow]:
    """The newest `limit` runs of `test` and their values (of `metric`), newest first."""
    runs = store.runs(test=test, backend=backend, suite=suite, limit=limit)
    values = store.values([r.id for r in runs], metric)
    return [HistoryRow(run, value) for run in runs for value in values.get(run.id, [])]


def render_history(rows: Sequence[HistoryRow], *, test: str, store_url: str, metric: str | None) -> str:
    what = metric or "all gated metrics"
    lines = [f"history of {printable(what)} for {printable(test)} (store {printable(store_url)})"]
    if not rows:
        lines.append("no stored runs; baselines are written by nightly and weekly runs")
        return "\n".join(lines) + "\n"
    groups: dict[tuple[str, str], list[HistoryRow]] = {}
    for row in rows:
        groups.setdefault(row.group, []).append(row)
    header = (
        "RUN",
        "CREATED (UTC)",
        "CADENCE",
        "COMMIT",
        "TRUSTED",
        "METRIC",
        "STEP",
        "VALUE",
        "BAND",
        "VERDICT",
    )
    for (backend, suite), group in groups.items():
        lines.append(f"\n{printable(backend)} / {printable(suite)}")
        table = [header] + [_cells(row) for row in group]
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        lines += [
            "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table
        ]
    untrusted = {row.run.id: row.run.untrusted_reason for row in rows if not row.run.trusted}
    for run_id, reason in sorted(untrusted.items()):
        if reason:
            lines.append(f"run {run_id} untrusted: {printable(reason)}")
    return "\n".join(lines) + "\n"


def _cells(row: HistoryRow) -> tuple[str, ...]:
    r, v = row.run, row.value
    step = "last" if v.coordinate.step == LAST_STEP else str(v.coordinate.step)
    band = f"[{v.low:.4g}, {v.high:.4g}]" if v.low is not None and v.high is not None else "-"
    return (
        str(r.id),
        r.created_at.strftime("%Y-%m-%d %H:%M"),
        printable(r.cadence),
        printable(r.commit or "-")[:10],
        "yes" if r.trusted else "no",
        printable(v.coordinate.metric),
        step,
        f"{v.value:.6g}",
        band,
        printable(v.verdict or "-"),
    )
