"""``sqla-jobs health --max-transaction-age`` and the gauges: a transaction left open keeps the jobs table's old
row versions.

A session idle in a transaction holds back PostgreSQL's VACUUM and InnoDB's purge for as long
as it stays open, and every claim then walks over more dead versions. The check names the oldest
such session and how to end it; SQLite, which keeps no old versions, refuses the option.
"""

from __future__ import annotations

import time

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from sqla_jobs.metrics import QueueMetrics
from sqla_jobs.otel import QueueMeter
from tests import app
from tests.conftest import Database, run_cli

APP = ("--app", "tests.app:queue")


def test_a_transaction_left_open_is_named_with_how_to_end_it(db: Database) -> None:
    if db.backend == "sqlite":
        refused = run_cli("health", *APP, "--max-oldest-age", "15m", "--max-transaction-age", "1m", env=db.env())
        assert refused.returncode == 2
        assert "--max-transaction-age: SQLite keeps no old row versions" in refused.stderr
        return

    idle = db.engine.connect().execution_options(isolation_level="REPEATABLE READ")
    try:
        # A read of the jobs table in a transaction that then sits idle, as a forgotten session does.
        me = idle.execute(text("SELECT pg_backend_pid()" if db.backend == "postgresql" else "SELECT CONNECTION_ID()"))
        session_id = me.scalar_one()
        idle.execute(text("SELECT count(*) FROM jobs"))
        time.sleep(2.5)
        bad = run_cli("health", *APP, "--max-oldest-age", "15m", "--max-transaction-age", "2s", env=db.env())
    finally:
        idle.rollback()
        idle.close()
    assert bad.returncode == 1, bad.stderr
    assert bad.stdout.startswith("UNHEALTHY: a transaction has been open for ")
    assert "(limit 2.0s)" in bad.stdout and len(bad.stdout.strip().splitlines()) == 1
    if db.backend == "postgresql":  # this test's own database: no other test's session is in it
        assert f"session {session_id} (application " in bad.stdout
        assert "idle in transaction" in bad.stdout
        assert f"end it (SELECT pg_terminate_backend({session_id}))" in bad.stdout
    else:  # InnoDB's purge is the server's: another test's transaction may be the older one
        assert "end it (KILL " in bad.stdout

    # Ended, it no longer counts: the oldest open transaction is younger than an hour.
    ok = run_cli("health", *APP, "--max-oldest-age", "15m", "--max-transaction-age", "1h", env=db.env())
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith("OK: ") and "; oldest open transaction " in ok.stdout and "(limit 1h)" in ok.stdout


def test_the_gauges_report_the_oldest_open_transaction(db: Database) -> None:
    """``sqla_jobs_oldest_transaction_seconds`` (Prometheus) and ``sqla_jobs.db.oldest_transaction``
    (OpenTelemetry): how long the oldest transaction has been open, where the backend keeps old versions."""
    registry = CollectorRegistry()
    prometheus = QueueMetrics(app.queue, db.engine, registry=registry, stats_max_age=0)
    reader = InMemoryMetricReader()
    otel = QueueMeter(app.queue, db.engine, meter_provider=MeterProvider(metric_readers=[reader]), stats_max_age=0)

    def read() -> tuple[float | None, float | None]:
        families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
        family = families.get("sqla_jobs_oldest_transaction_seconds")
        points = [point.value for resource in reader.get_metrics_data().resource_metrics
                  for scope in resource.scope_metrics for metric in scope.metrics
                  if metric.name == "sqla_jobs.db.oldest_transaction" for point in metric.data.data_points]
        return (family.samples[0].value if family else None), (points[0] if points else None)

    idle = db.engine.connect()
    if db.backend != "sqlite":
        idle = idle.execution_options(isolation_level="REPEATABLE READ")
    try:
        idle.execute(text("SELECT count(*) FROM jobs"))
        time.sleep(1.5)
        held = read()
    finally:
        idle.rollback()
        idle.close()
        prometheus.detach()
        otel.detach()
    if db.backend == "sqlite":  # no old row versions to hold back: neither gauge is there
        assert held == (None, None)
        return
    assert all(seconds is not None and 1.5 <= seconds < 600 for seconds in held), held
