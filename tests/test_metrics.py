"""Prometheus metrics and the hooks that feed them, scraped over HTTP and parsed like Prometheus would."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session

from sqla_jobs import JobEvent, Worker
from sqla_jobs.metrics import QueueMetrics
from tests import forkserver
from tests.app import Job, queue
from tests.conftest import ROOT, Database
from tests.test_operations import APP, effects, enqueue, job_row
from tests.test_stats import db_now


def samples(exposition: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} from the text format."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }


def value(found: dict[Any, float], name: str, **labels: str) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def enqueue_mix(db: Database) -> None:
    for _ in range(3):
        enqueue(db, "noop")
    enqueue(db, "fail", max_attempts=1)  # fails once, dead-lettered
    enqueue(db, "flaky", payload={"succeed_on": 2})  # fails, retried, finishes
    enqueue(db, "noop", run_at=db_now(db.engine) + timedelta(hours=1))  # scheduled


def test_worker_serves_metrics_over_http(db: Database) -> None:
    enqueue_mix(db)
    port = free_port()
    worker = forkserver.Popen(
        [sys.executable, "-m", "sqla_jobs.cli", "worker", *APP, "--poll-interval", "0.05",
         "--metrics-port", str(port), "--metrics-addr", "127.0.0.1"],
        env=db.env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    found: dict[Any, float] = {}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    found = samples(response.read().decode())
            except OSError:
                found = {}
            if (value(found, "sqla_jobs_jobs_finished_total", kind="flaky") == 1
                    and value(found, "sqla_jobs_queue_length", queue="default", state="ready") == 0
                    # the table figures are cached for a moment: wait until they show the last run ended too
                    and value(found, "sqla_jobs_queue_length", queue="default", state="running") == 0
                    and value(found, "sqla_jobs_dead_jobs", kind="fail") == 1):
                break
            time.sleep(0.2)
    finally:
        worker.terminate()
        out, _ = worker.communicate(timeout=60)
    assert found, out
    assert value(found, "sqla_jobs_jobs_finished_total", kind="noop") == 3
    assert value(found, "sqla_jobs_jobs_finished_total", kind="flaky") == 1
    assert value(found, "sqla_jobs_jobs_failed_total", kind="flaky") == 1
    assert value(found, "sqla_jobs_jobs_retried_total", kind="flaky") == 1
    assert value(found, "sqla_jobs_jobs_failed_total", kind="fail") == 1
    assert value(found, "sqla_jobs_jobs_dead_lettered_total", kind="fail") == 1
    assert value(found, "sqla_jobs_jobs_retried_total", kind="fail") is None
    assert value(found, "sqla_jobs_job_run_seconds_count", kind="noop") == 3
    assert value(found, "sqla_jobs_job_run_seconds_count", kind="flaky") == 2  # the failed run and the good one
    assert value(found, "sqla_jobs_job_run_seconds_bucket", kind="noop", le="+Inf") == 3
    assert value(found, "sqla_jobs_queue_length", queue="default", state="scheduled") == 1
    assert value(found, "sqla_jobs_queue_length", queue="default", state="running") == 0
    assert value(found, "sqla_jobs_oldest_pending_age_seconds", queue="default") == 0
    assert value(found, "sqla_jobs_dead_jobs", kind="fail") == 1


def test_python_api_gauges_follow_the_table(db: Database) -> None:
    registry = CollectorRegistry()
    metrics = QueueMetrics(queue, db.engine, registry=registry, stats_max_age=0)
    try:
        now = db_now(db.engine)
        enqueue(db, "noop", run_at=now - timedelta(minutes=10))
        enqueue(db, "noop", queue="mail", run_at=now - timedelta(seconds=30))
        retry = enqueue(db, "flaky", attempts=1, run_at=now + timedelta(hours=1))  # failed once, waits
        found = samples(generate_latest(registry).decode())
        assert value(found, "sqla_jobs_retrying_jobs", kind="flaky") == 1
        age = value(found, "sqla_jobs_oldest_pending_age_seconds", queue="default")
        assert age is not None and 600 <= age < 660
        assert value(found, "sqla_jobs_queue_length", queue="mail", state="ready") == 1
        assert value(found, "sqla_jobs_jobs_finished_total", kind="noop") is None  # nothing ran yet

        Worker(db.engine, queue, poll_interval=0.05).run(burst=True, install_signals=False)
        found = samples(generate_latest(registry).decode())
        assert value(found, "sqla_jobs_jobs_finished_total", kind="noop") == 2
        assert value(found, "sqla_jobs_queue_length", queue="default", state="ready") == 0
        assert value(found, "sqla_jobs_oldest_pending_age_seconds", queue="default") == 0
        with Session(db.engine) as session, session.begin():
            assert queue.cancel(session, retry) == "cancelled"
        found = samples(generate_latest(registry).decode())
        assert value(found, "sqla_jobs_retrying_jobs", kind="flaky") == 0  # a kind that recovers reports 0
    finally:
        metrics.detach()
    found = samples(generate_latest(registry).decode())
    assert found == {}


def test_blocked_jobs_are_a_state_of_the_queue_length(db: Database) -> None:
    registry = CollectorRegistry()
    metrics = QueueMetrics(queue, db.engine, registry=registry, stats_max_age=0)
    try:
        with Session(db.engine) as session, session.begin():
            upstream = Job(kind="noop", payload={})
            session.add_all([Job(kind="noop", payload={}, depends_on=[upstream]) for _ in range(2)])
        found = samples(generate_latest(registry).decode())
        assert value(found, "sqla_jobs_queue_length", queue="default", state="blocked") == 2
        assert value(found, "sqla_jobs_queue_length", queue="default", state="ready") == 1
        Worker(db.engine, queue, poll_interval=0.05).run(burst=True, install_signals=False)
        found = samples(generate_latest(registry).decode())
        assert value(found, "sqla_jobs_queue_length", queue="default", state="blocked") == 0
        assert value(found, "sqla_jobs_jobs_finished_total", kind="noop") == 3
    finally:
        metrics.detach()


def test_gauges_are_cached_between_scrapes(db: Database) -> None:
    registry = CollectorRegistry()
    metrics = QueueMetrics(queue, db.engine, registry=registry, stats_max_age=3600)
    try:
        enqueue(db, "noop")
        first = samples(generate_latest(registry).decode())
        enqueue(db, "noop")
        second = samples(generate_latest(registry).decode())
        assert value(first, "sqla_jobs_queue_length", queue="default", state="ready") == 1
        assert value(second, "sqla_jobs_queue_length", queue="default", state="ready") == 1  # not re-read
    finally:
        metrics.detach()


def test_missing_prometheus_client_says_what_to_install(db: Database) -> None:
    code = ("import sys; sys.modules['prometheus_client'] = None; from sqla_jobs.cli import main; "
            "sys.exit(main(['worker', '--app', 'tests.app:queue', '--metrics-port', '0', '--burst']))")
    result = forkserver.run([sys.executable, "-c", code], env=db.env(), cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert 'pip install "sqla-jobs[prometheus]"' in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("cancel", [False, True])
def test_reaper_reports_a_lost_worker_as_a_failed_attempt(db: Database, cancel: bool) -> None:
    """The run of a worker that died counts as a failed attempt for hooks (and so for metrics);
    if a cancel was requested while it ran, the job ends cancelled instead of being retried."""
    job_id = enqueue(db, "sleep", payload={"seconds": 30})
    doomed = forkserver.Popen(
        [sys.executable, "-m", "sqla_jobs.cli", "worker", *APP, "--poll-interval", "0.05", "--lease", "1",
         "--heartbeat", "0.3"],
        env=db.env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while effects(db, job_id) != ["start"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert effects(db, job_id) == ["start"]
    finally:
        doomed.kill()  # not os.kill(pid): a pid outlives its process (tests/forkserver.py)
        doomed.wait(timeout=30)
    if cancel:
        with Session(db.engine) as session, session.begin():
            assert queue.cancel(session, job_id) == "requested"
    time.sleep(1.5)  # the lease runs out
    seen: list[JobEvent] = []
    event_name = "cancelled" if cancel else "failed"
    queue.on(event_name)(seen.append)
    try:
        with Session(db.engine) as session, session.begin():
            session.execute(queue.job_model.__table__.update().values(payload={"seconds": 0.05}))
        Worker(db.engine, queue, poll_interval=0.05).run(burst=True, install_signals=False)
    finally:
        queue.off(event_name, seen.append)
    assert len(seen) == 1
    event = seen[0]
    assert (event.id, event.kind, event.queue, event.attempt) == (job_id, "sleep", "default", 1)
    assert event.error is not None and event.error.startswith("WorkerLost")
    row = job_row(db, job_id)
    assert (row.state, row.attempts) == (("cancelled", 1) if cancel else ("finished", 2))


def test_metrics_port_in_use_is_a_one_line_error(db: Database) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = forkserver.run(
            [sys.executable, "-m", "sqla_jobs.cli", "worker", *APP, "--burst", "--metrics-port", str(port),
             "--metrics-addr", "127.0.0.1"],
            env=db.env(), cwd=ROOT, capture_output=True, text=True, timeout=60,
        )
    assert result.returncode == 2
    assert f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
