"""The soak's monitor: what the database says at each window's end, the live line, and the windows the
report is made of (pickup percentiles from the handler starts, table figures, vacuum runs).
"""

from __future__ import annotations

import statistics
from array import array
from typing import Any

from sqlalchemy import Engine, func, select

from .run import BenchJob, queue
from .soak_load import Tally
from .soak_report import Window

__all__ = ["pending_and_running", "percentile", "progress_line", "sample_now", "table_figures", "windows_of"]


def pending_and_running(engine: Engine) -> tuple[int, int]:
    """Pending and running jobs: each count is served by its partial index."""
    with engine.connect() as conn:
        pending, running = (
            conn.execute(select(func.count()).select_from(BenchJob).where(BenchJob.state == state)).scalar_one()
            for state in ("pending", "running")
        )
    return pending, running


def table_figures(engine: Engine) -> dict[str, float]:
    with engine.connect() as conn:
        return queue.driver(conn).bench_table_stats(conn)


def progress_line(index: int, width: float, sample: dict[str, Any], tally: Tally) -> str:
    """A live line per window; the handler figures of the window before (complete by now) come in the report."""
    figures = sample["figures"]
    parts = []
    if "table_bytes" in figures:
        parts.append(f"table {figures['table_bytes'] / 1e6:.1f} MB + indexes {figures['index_bytes'] / 1e6:.1f} MB")
    if "dead_tuples" in figures:
        parts.append(f"{figures['dead_tuples']:.0f} dead tuples, {figures['autovacuum_count']:.0f} autovacuums")
    size = "".join(", " + part for part in parts)
    return (f"  {(index + 1) * width:6.0f}s {sample['phase']}: enqueued {tally.sent:,}, run {tally.unique:,}, "
            f"pending {sample['pending']:,}{size}")


def percentile(values: array[float], p: int) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def sample_now(engine: Engine, tally: Tally, phase: str) -> dict[str, Any]:
    """What the database says at a window's end; the handler figures are joined in once all are shipped."""
    pending, running = pending_and_running(engine)
    return {"phase": phase, "pending": pending, "running": running, "pruned_total": tally.pruned,
            "figures": table_figures(engine)}


def windows_of(samples: list[dict[str, Any]], baseline: dict[str, float], tally: Tally, origin: float,
             width: float) -> list[Window]:
    enqueued_by_window: dict[int, int] = {}
    for stamp, count in zip(tally.enqueue_times, tally.enqueue_counts, strict=True):
        index = int((stamp - origin) // width)
        enqueued_by_window[index] = enqueued_by_window.get(index, 0) + count
    windows = []
    previous = baseline
    for index, sample in enumerate(samples):
        figures = sample["figures"]
        latencies = tally.latency_by_window.get(index, array("d"))
        counters = ("autovacuum_count", "autoanalyze_count", "vacuum_count")
        runs = {key: figures[key] - previous.get(key, 0.0) for key in counters if key in figures}
        previous = figures
        windows.append(Window(
            start=index * width, phase=sample["phase"],
            enqueued_per_s=enqueued_by_window.get(index, 0) / width, run_per_s=len(latencies) / width,
            pickup_p50_ms=percentile(latencies, 50), pickup_p95_ms=percentile(latencies, 95),
            pickup_p99_ms=percentile(latencies, 99), pickup_max_ms=max(latencies) if latencies else None,
            pending=sample["pending"], running=sample["running"], pruned_total=sample["pruned_total"],
            table_bytes=figures.get("table_bytes"), index_bytes=figures.get("index_bytes"),
            live_tuples=figures.get("live_tuples"), dead_tuples=figures.get("dead_tuples"),
            hot_update_share=figures.get("hot_update_share"),
            autovacuum_runs=runs.get("autovacuum_count"), autoanalyze_runs=runs.get("autoanalyze_count"),
            vacuum_runs=runs.get("vacuum_count"),
        ))
    return windows
