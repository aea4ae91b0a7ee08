"""The soak's report: its windows, the totals, and the files (JSON, CSV, a plot) that show drift.

Shared by ``sqla-jobs bench --soak`` and ``docs/bench/compare.py --soak``, which
plots sqla-jobs and pgqueuer on the same axes. The plot needs matplotlib (the
``bench`` extra); without it the JSON and CSV are still written.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["SoakReport", "Window", "plot", "write_outputs"]


@dataclasses.dataclass
class Window:
    """One window of the soak: handler figures of the jobs that started in it, database figures at its end."""

    start: float  # seconds since the producer started
    phase: str  # "soak" while the producer runs, "drain" after
    enqueued_per_s: float
    run_per_s: float
    pickup_p50_ms: float | None
    pickup_p95_ms: float | None
    pickup_p99_ms: float | None
    pickup_max_ms: float | None
    pending: int
    running: int
    pruned_total: int = 0
    table_bytes: float | None = None  # the heap alone (pg_relation_size)
    index_bytes: float | None = None  # all its indexes (pg_indexes_size)
    live_tuples: float | None = None
    dead_tuples: float | None = None
    hot_update_share: float | None = None  # HOT updates / updates since the table was created
    autovacuum_runs: float | None = None  # in this window
    autoanalyze_runs: float | None = None
    vacuum_runs: float | None = None  # VACUUMs run by hand (the soak's --soak-vacuum)


@dataclasses.dataclass
class SoakReport:
    windows: list[Window]
    totals: dict[str, Any]
    system: str = ""
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    files: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Every enqueued job ran, exactly once, and nothing is left."""
        t = self.totals
        return (t["missing"] == 0 and t.get("duplicates", 0) == 0 and t.get("pending_left", 0) == 0
                and t.get("running_left", 0) == 0 and t.get("dead", 0) == 0)

    def summary(self) -> dict[str, Any]:
        """The figures the issue's soak target is about, over the producer's windows after the first minute."""
        soak = [w for w in self.windows if w.phase == "soak"]
        settled = [w for w in soak if w.start >= 60] or soak
        out: dict[str, Any] = {}
        if soak:
            out["run_per_s_median"] = statistics.median(w.run_per_s for w in soak)
            out["enqueued_per_s_median"] = statistics.median(w.enqueued_per_s for w in soak)
            p99 = [w.pickup_p99_ms for w in soak if w.pickup_p99_ms is not None]
            out["pickup_p99_ms_worst"] = max(p99) if p99 else None
            out["pickup_p50_ms_median"] = statistics.median(
                [w.pickup_p50_ms for w in soak if w.pickup_p50_ms is not None] or [0.0])
            out["pending_max"] = max(w.pending for w in soak)
            out["pending_last"] = soak[-1].pending
            sizes = [(w.table_bytes or 0) + (w.index_bytes or 0) for w in settled if w.table_bytes is not None]
            if sizes:
                out["bytes_after_first_minute_min"] = min(sizes)
                out["bytes_after_first_minute_max"] = max(sizes)
                out["bytes_last"] = sizes[-1]
            runs = [w.autovacuum_runs for w in self.windows if w.autovacuum_runs is not None]
            out["autovacuum_runs"] = sum(runs) if runs else None
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"system": self.system, "settings": self.settings, "totals": self.totals, "summary": self.summary(),
                "complete": self.complete, "windows": [dataclasses.asdict(w) for w in self.windows],
                "files": self.files}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SoakReport:
        names = {f.name for f in dataclasses.fields(Window)}
        windows = [Window(**{k: v for k, v in w.items() if k in names}) for w in data["windows"]]
        return cls(windows, data["totals"], data.get("system", ""), data.get("settings", {}), data.get("files", {}))

    def summary_text(self) -> str:
        t, s = self.totals, self.summary()
        lines = [f"\n{self.system} soak: {t['enqueued']:,} jobs enqueued in {t['soak_seconds']:g}s "
                 f"({t['enqueue_rate']:,.0f}/s); run {t['run']:,}, missing {t['missing']}, duplicates "
                 f"{t.get('duplicates', '— (reruns below)')}, left pending {t['pending_left']}; drained after "
                 f"{_num(t['drained_after_seconds'], 1)}s",
                 f"{'window':>7} {'phase':<5} {'enq/s':>8} {'run/s':>8} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} "
                 f"{'pending':>8} {'table MB':>8} {'index MB':>8} {'dead tup':>9} {'HOT %':>6} {'autovac':>7} "
                 f"{'vacuum':>6}"]
        for w in self.windows:
            lines.append(
                f"{w.start:>6.0f}s {w.phase:<5} {w.enqueued_per_s:>8,.0f} {w.run_per_s:>8,.0f} "
                f"{_num(w.pickup_p50_ms, 1):>7} {_num(w.pickup_p95_ms, 1):>7} {_num(w.pickup_p99_ms, 1):>7} "
                f"{w.pending:>8,} {_mb(w.table_bytes):>8} {_mb(w.index_bytes):>8} {_num(w.dead_tuples, 0):>9} "
                f"{_num(None if w.hot_update_share is None else 100 * w.hot_update_share, 0):>6} "
                f"{_num(w.autovacuum_runs, 0):>7} {_num(w.vacuum_runs, 0):>6}")
        lines.append("summary: " + ", ".join(f"{k} {_num(v, 1)}" for k, v in s.items()))
        if "faults" in t:
            lines.append(f"faults ({len(t['faults'])}): " + "; ".join(
                f"{f['at']:.0f}s {f['kind']} ({f['detail']})" for f in t["faults"]))
            lines.append(f"reruns after faults (a start seen again; each job finished once): {t['reruns']}")
        if t.get("server_autovacuum") == "off":
            lines.append("note: the server runs with autovacuum = off: nothing reclaims dead rows unless "
                         "--soak-vacuum does")
        if not self.complete:
            lines.append("INCOMPLETE: not every enqueued job ran exactly once (see the totals above)")
        return "\n".join(lines)


def _num(value: Any, digits: int) -> str:
    return "—" if not isinstance(value, (int, float)) else f"{value:,.{digits}f}"


def _mb(value: float | None) -> str:
    return "—" if value is None else f"{value / 1e6:.1f}"


# -- files ---------------------------------------------------------------------------------


def write_outputs(reports: dict[str, SoakReport], out: Path, name: str = "soak") -> dict[str, str]:
    """``NAME.json`` (every report), ``NAME.csv`` (one row per system and window), ``NAME.png`` if it can."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": str(out / f"{name}.json"), "csv": str(out / f"{name}.csv")}
    fields = [f.name for f in dataclasses.fields(Window)]
    with open(files["csv"], "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["system", *fields])
        for system, report in reports.items():
            for w in report.windows:
                writer.writerow([system, *(getattr(w, f) for f in fields)])
    png = out / f"{name}.png"
    problem = plot(reports, png)
    if problem is None:
        files["png"] = str(png)
    else:
        files["plot"] = problem
    for report in reports.values():
        report.files = files
    Path(files["json"]).write_text(json.dumps({s: r.as_dict() for s, r in reports.items()}, indent=2) + "\n")
    return files


def plot(reports: dict[str, SoakReport], path: Path) -> str | None:
    """Four panels over time, one colour per system; None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is missing (pip install 'sqla-jobs[bench]')"
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    dead_axis = axes[3].twinx()
    dead_axis.set_ylabel("dead tuples (dotted)")
    for colour, (system, report) in zip(colours, reports.items(), strict=False):
        ws = report.windows
        width = report.settings.get("window", 10)
        x = [w.start + width for w in ws]  # the database figures are read at each window's end
        axes[0].plot(x, [w.run_per_s for w in ws], color=colour, label=f"{system} run/s")
        axes[0].plot(x, [w.enqueued_per_s for w in ws], color=colour, linestyle=":", label=f"{system} enqueued/s")
        for style, key in (("-", "pickup_p50_ms"), ("--", "pickup_p95_ms"), (":", "pickup_p99_ms")):
            points = [(xi, getattr(w, key)) for xi, w in zip(x, ws, strict=True) if getattr(w, key)]
            if points:
                axes[1].plot(*zip(*points, strict=True), color=colour, linestyle=style,
                             label=f"{system} {key.split('_')[1]}")
        axes[2].plot(x, [w.pending for w in ws], color=colour, label=f"{system} pending")
        if any(w.table_bytes is not None for w in ws):
            axes[3].plot(x, [(w.table_bytes or 0) / 1e6 for w in ws], color=colour, label=f"{system} table MB")
            axes[3].plot(x, [(w.index_bytes or 0) / 1e6 for w in ws], color=colour, linestyle="--",
                         label=f"{system} indexes MB")
            dead_axis.plot(x, [w.dead_tuples or 0 for w in ws], color=colour, linestyle=":", alpha=0.8)
            vacuums = [xi for xi, w in zip(x, ws, strict=True) if w.autovacuum_runs or w.vacuum_runs]
            for i, xi in enumerate(vacuums):
                axes[3].axvline(xi, color=colour, alpha=0.3, linewidth=3,
                                label=f"{system} (auto)vacuum ran" if i == 0 else None)
        for i, fault in enumerate(report.totals.get("faults", [])):  # soak_faults: what hit the workers, and when
            for ax in axes:
                ax.axvline(fault["at"], color="tab:red", alpha=0.5, linewidth=1,
                           label="fault" if i == 0 and ax is axes[2] else None)
            axes[0].annotate(fault["kind"], (fault["at"], 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                             color="tab:red", rotation=90, va="top", ha="right")
        if report.settings.get("seconds"):
            for ax in axes:
                ax.axvline(report.settings["seconds"], color=colour, linestyle="-.", alpha=0.4)
    axes[0].set_ylabel("jobs/s")
    axes[1].set_ylabel("pickup ms")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("pending jobs")
    axes[3].set_ylabel("MB")
    axes[3].set_xlabel("seconds since the producer started, at each window's end (dash-dot: the producer stops)")
    title = " vs ".join(reports)
    first = next(iter(reports.values()))
    rate = first.settings.get("rate")
    fig.suptitle(f"soak: {title}, {'max rate' if rate is None else f'{rate:g} jobs/s'}, "
                 f"windows of {first.settings.get('window', 10):g}s")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return None
