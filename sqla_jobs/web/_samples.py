"""The dashboard's history: a small table of samples of the four figures, so the charts survive a restart.

Design. One sample is a handful of rows ``(taken_at, series, label, value)``
written at most once per ``interval`` (default 60 s): per queue name its
``ready``, ``scheduled``, ``running``, ``blocked`` and ``oldest`` (oldest pending age, s);
``finished`` (jobs finished per minute over the last interval); per kind its
``dead`` (dead letters in total), ``retrying`` (failed at least once, waiting
for the next attempt), ``p50`` and ``p95`` (run time, s, over the last
interval). Each write first deletes the samples older than ``keep``
(default 2 days), so the table stays at about ``keep / interval`` samples:
2,880 samples of ~10 rows for one queue and a few kinds.

Who writes. Workers are not touched: a sample costs them nothing. The
dashboard writes one when a page or the live refresh finds the latest sample
older than ``interval`` (any number of dashboard processes share the table;
a rare duplicate sample is harmless), and the standalone ``sqla-jobs
dashboard`` also writes on a timer. To keep a history while nobody looks, call
``record_sample(engine, queue)`` from cron or a scheduler.

The table is ``<jobs table>_samples`` in the jobs table's schema. Declared
with ``samples_table(queue, Base.metadata)`` it is one of your tables
(``create_all``, alembic autogenerate); undeclared, the dashboard creates it
on first use, in a metadata of its own so your metadata is never changed
behind your back.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Engine,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    inspect,
    text,
)

from .._admin import Admin
from .._companion import companion_table
from ..drivers import _dashboard as sql_dashboard
from ..drivers import sync_engine_for

__all__ = ["KEEP", "SAMPLE_INTERVAL", "due", "record_sample", "samples_table", "series"]

SAMPLE_INTERVAL = 60.0
KEEP = 2 * 86400.0
_MAX_POINTS = 360  # a chart needs no more points than it has pixels to spare


def samples_table(queue: Admin[Any], metadata: MetaData | None = None) -> Table:
    """The samples table of ``queue``'s jobs table: ``<jobs table>_samples``, in the jobs table's schema.

    Declare it in your own metadata, next to your models, with
    ``samples_table(queue, Base.metadata)``: then ``create_all`` and alembic
    autogenerate manage it like your other tables. Otherwise it lives in a
    metadata of its own and the dashboard creates it on first use.
    """
    return companion_table(queue, "samples", metadata, lambda name: [
        Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True),
        Column("taken_at", DateTime(timezone=True), nullable=False, server_default=text("CURRENT_TIMESTAMP")),
        Column("series", String(16), nullable=False),
        Column("label", String(255), nullable=False, server_default=""),
        Column("value", Float, nullable=False),
        Index(f"ix_{name}_taken_at", "taken_at"),
    ])


def due(engine: Engine, queue: Admin[Any], interval: float = SAMPLE_INTERVAL) -> bool:
    """Whether the latest sample is older than ``interval`` seconds (or there is none)."""
    table = samples_table(queue)
    with engine.connect() as conn:
        if not inspect(conn).has_table(table.name, schema=table.schema):
            return True
        age = sql_dashboard.sample_age(queue.driver(conn), conn, table)
    return age is None or age >= interval


def record_sample(
    engine: Engine | Any, queue: Admin[Any], *, interval: float = SAMPLE_INTERVAL, keep: float = KEEP
) -> int:
    """Write one sample of the figures now and prune samples older than ``keep`` seconds; returns rows written.

    ``engine``: an ``Engine``, or an ``AsyncEngine`` (written through a sync engine on the same database).

    Run it every ``interval`` seconds (cron, a scheduler) to keep charts while no
    dashboard is open; run time and throughput cover the last ``interval``.
    Creates the samples table if it is missing.
    """
    if not isinstance(engine, Engine):
        twin = sync_engine_for(engine)
        try:
            return record_sample(twin, queue, interval=interval, keep=keep)
        finally:
            twin.dispose()
    table = samples_table(queue)
    table.create(engine, checkfirst=True)
    stats = queue.stats(engine, window=interval)
    rows: list[dict[str, Any]] = []
    for q in stats.queues:
        rows += [
            {"series": "ready", "label": q.queue, "value": q.ready},
            {"series": "scheduled", "label": q.queue, "value": q.scheduled},
            {"series": "running", "label": q.queue, "value": q.running},
            {"series": "blocked", "label": q.queue, "value": q.blocked},
            {"series": "oldest", "label": q.queue, "value": q.oldest_pending_age or 0.0},
        ]
    rows.append({"series": "finished", "label": "", "value": stats.throughput})
    rows += [{"series": "dead", "label": d.kind, "value": d.total} for d in stats.dead]
    rows += [{"series": "retrying", "label": kind, "value": n} for kind, n in stats.retrying.items()]
    for r in stats.run_times:
        rows += [{"series": "p50", "label": r.kind, "value": r.p50}, {"series": "p95", "label": r.kind, "value": r.p95}]
    driver = queue.driver(engine)
    with driver.write(engine) as conn:
        sql_dashboard.prune_samples(driver, conn, table, keep)
        sql_dashboard.write_samples(driver, conn, table, rows)
    return len(rows)


def series(
    engine: Engine, queue: Admin[Any], span: float, interval: float = SAMPLE_INTERVAL
) -> dict[str, Any]:
    """The samples of the last ``span`` seconds as chart data.

    ``{"times": [unix seconds...], "series": {name: {label: [value or None, ...]}}, "from": t, "to": t}``,
    at most ``_MAX_POINTS`` columns: the span is cut into that many buckets and
    each point is the largest sample in its bucket, so a spike stays visible
    when a day is drawn. Where no sample was written for longer than two sample
    ``interval``s (nobody looked, the dashboard was down), a point of ``None``
    values marks the gap, so a chart shows it instead of a straight line across.
    ``from``/``to``: the time axis, the chosen window ending now (``span`` seconds):
    the first sample is drawn where it was taken in it. (Drawn from the first
    sample, one sample gave a minute-wide "last hour"; uPlot left to itself
    spread a single point over years.)
    """
    table = samples_table(queue)
    step = span / _MAX_POINTS
    now = time.time()
    with engine.connect() as conn:
        if not inspect(conn).has_table(table.name, schema=table.schema):
            return {"times": [], "series": {}, "from": round(now - span), "to": round(now)}
        rows = sql_dashboard.read_samples(queue.driver(conn), conn, table, span, step)
    by_bucket: dict[int, dict[tuple[str, str], float]] = defaultdict(dict)
    for bucket, name, label, value in rows:
        by_bucket[int(bucket)][(name, label)] = float(value)
    buckets = sorted(by_bucket, reverse=True)  # the oldest (largest age) first
    keys = sorted({key for b in buckets for key in by_bucket[b]})
    columns: list[tuple[float, dict[tuple[str, str], float]]] = []
    gap = 2 * max(step, interval)
    for b in buckets:
        at = now - b * step
        if columns and at - columns[-1][0] > gap:
            columns.append(((at + columns[-1][0]) / 2, {}))  # no sample here: a gap, every value None
        columns.append((at, by_bucket[b]))
    out: dict[str, dict[str, list[float | None]]] = defaultdict(dict)
    for name, label in keys:
        out[name][label] = [values.get((name, label)) for _, values in columns]
    return {"times": [round(at) for at, _ in columns], "series": out, "from": round(now - span), "to": round(now)}
