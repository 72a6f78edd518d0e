"""`history plot`: a metric's stored values run by run, the band each was held to, and verdicts.

One panel per history (backend, suite) and coordinate, since histories never mix.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from miles.metrics.report import HistoryRow, history_rows
from miles.metrics.spec import LAST_STEP
from miles.metrics.store import HistoryStore

MAX_PANELS = 12
_COLORS = {"PASS": "tab:green", "FAIL": "tab:red", "ERROR": "black", "INACTIVE": "tab:gray"}


def plot_history(
    store: HistoryStore,
    test: str,
    metric: str,
    output: Path | str,
    *,
    backend: str | None = None,
    suite: str | None = None,
    limit: int = 100,
) -> int:
    """Write the plot to `output`; returns the number of panels. LookupError if nothing is stored."""
    rows = history_rows(store, test, backend=backend, suite=suite, metric=metric, limit=limit)
    if not rows:
        where = "/".join(x for x in (backend, suite) if x) or "any backend"
        raise LookupError(f"no stored values of '{metric}' for {test} on {where} in {store.url}")
    panels: dict[tuple, list[HistoryRow]] = {}
    for row in sorted(rows, key=lambda r: (r.run.created_at, r.run.id)):
        c = row.value.coordinate
        panels.setdefault((*row.group, c.steps_key, c.constraint_key, c.step), []).append(row)
    keys = list(panels)[:MAX_PANELS]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.8 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys, strict=True):
        _panel(ax, key, panels[key], metric)
    if len(panels) > MAX_PANELS:
        fig.suptitle(f"first {MAX_PANELS} of {len(panels)} coordinates; narrow with --backend/--suite")
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp")  # a half-drawn image never takes the name
    fig.savefig(tmp, dpi=100, format=output.suffix.lstrip(".") or "png")
    plt.close(fig)
    os.replace(tmp, output)
    return len(keys)


def _panel(ax, key: tuple, rows: list[HistoryRow], metric: str) -> None:
    backend, suite, steps_key, _constraint, step = key
    x = list(range(len(rows)))
    values = [r.value.value if math.isfinite(r.value.value) else math.nan for r in rows]
    ax.plot(x, values, color="tab:blue", linewidth=1, zorder=1)
    banded = [
        (i, r.value) for i, r in enumerate(rows) if r.value.low is not None and r.value.high is not None
    ]
    if banded:
        bx = [i for i, _ in banded]
        ax.fill_between(bx, [v.low for _, v in banded], [v.high for _, v in banded], color="tab:blue", alpha=0.15,
                        step="mid", label="band")  # fmt: skip
        ax.plot(
            bx, [v.ref for _, v in banded], color="tab:blue", linestyle="--", linewidth=0.8, label="baseline"
        )
    for status, color in _COLORS.items():
        pts = [(i, values[i]) for i, r in enumerate(rows) if (r.value.verdict or "INACTIVE") == status]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, s=24, zorder=3, label=status)
    untrusted = [(i, values[i]) for i, r in enumerate(rows) if not r.run.trusted]
    if untrusted:
        ax.scatter([p[0] for p in untrusted], [p[1] for p in untrusted], facecolors="none", edgecolors="tab:red",
                   s=90, zorder=4, label="untrusted run")  # fmt: skip
    where = "last" if step == LAST_STEP else f"step {step}"
    declared = "" if steps_key == "last" else f" (steps={steps_key})"
    ax.set_title(f"{metric} @ {where}{declared} - {backend}/{suite}", fontsize=9)
    ax.set_xticks(x, [str(r.run.id) for r in rows], fontsize=7)
    ax.set_xlabel("run id (oldest to newest)", fontsize=8)
    ax.legend(fontsize=7, loc="best")
