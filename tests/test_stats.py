"""The four figures, checked against hand-built tables of jobs with known ages and run times."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, Engine, insert, select, text
from sqlalchemy.orm import Session

# Internal on purpose: the duration parser has no Python API (the CLI's --older-than/--since use it),
# and percentile is the Python twin of PostgreSQL's percentile_cont, compared with it directly.
from sqla_jobs._durations import format_duration, parse_duration
from sqla_jobs._stats import percentile
from sqla_jobs.errors import ConfigError
from tests.app import DeadJob, Job, queue
from tests.conftest import Database


def db_now(engine: Engine) -> datetime:
    """The database clock, as an aware UTC datetime."""
    with engine.connect() as conn:
        now = conn.execute(select(queue.driver(conn).now())).scalar()
    assert isinstance(now, datetime)
    return now if now.tzinfo else now.replace(tzinfo=timezone.utc)


def add_jobs(engine: Engine, rows: list[dict[str, Any]]) -> None:
    # Every row names every column: an executemany takes its columns from the first row.
    base = {"kind": "noop", "queue": "default", "payload": {}, "priority": 0, "attempts": 0, "max_attempts": 5,
            "state": "pending", "locked_at": None, "lease_expires_at": None, "claim_token": None,
            "finished_at": None, "created_at": db_now(engine)}
    with engine.begin() as conn:
        conn.execute(insert(Job.__table__), [{**base, **r} for r in rows])


def add_dead(engine: Engine, rows: list[dict[str, Any]]) -> None:
    base = {"kind": "noop", "queue": "default", "payload": {}, "priority": 0, "attempts": 5, "max_attempts": 5,
            "last_error": "ValueError: boom", "errors": [{"attempt": 5, "at": "x", "error": "ValueError: boom"}],
            "created_at": db_now(engine), "run_at": None}
    with engine.begin() as conn:
        conn.execute(insert(DeadJob.__table__), [{**base, **r} for r in rows])


def finished(now: datetime, kind: str, seconds: float, ago: float, state: str = "finished") -> dict[str, Any]:
    end = now - timedelta(seconds=ago)
    return {"kind": kind, "state": state, "attempts": 1, "run_at": end - timedelta(seconds=seconds + 1),
            "locked_at": end - timedelta(seconds=seconds), "finished_at": end}


def build_known_table(engine: Engine) -> datetime:
    now = db_now(engine)
    s = timedelta(seconds=1)
    add_jobs(engine, [
        # ready: due 600 s, 60 s and 5 s ago on "default", 30 s ago on "mail"
        {"run_at": now - 600 * s}, {"run_at": now - 60 * s}, {"run_at": now - 5 * s},
        {"run_at": now - 30 * s, "queue": "mail"},
        # scheduled: a retry in backoff and a delayed job
        {"run_at": now + 3600 * s, "attempts": 1}, {"run_at": now + 86400 * s},
        {"run_at": now + 60 * s, "kind": "a", "attempts": 2},  # kind a failed twice, retries in a minute
        # running: one healthy lease, one expired (its worker is gone)
        {"state": "running", "run_at": now - 20 * s, "locked_at": now - 10 * s, "attempts": 1,
         "lease_expires_at": now + 50 * s, "claim_token": "a"},
        {"state": "running", "run_at": now - 200 * s, "locked_at": now - 190 * s, "attempts": 1,
         "lease_expires_at": now - 100 * s, "claim_token": "b"},
        # finished within the hour: kind a took 1, 2, 3, 4, 10 s; kind b 0.5 s
        *(finished(now, "a", secs, 600) for secs in (1, 2, 3, 4, 10)),
        finished(now, "b", 0.5, 120),
        # outside the window or not a completed run: must not count
        finished(now, "a", 100, 7200),
        finished(now, "a", 50, 60, state="cancelled"),
    ])
    add_dead(engine, [
        {"id": 900, "kind": "a", "failed_at": now - 7200 * s},
        {"id": 901, "kind": "a", "failed_at": now - 60 * s},
        {"id": 902, "kind": "b", "failed_at": now - 10 * s},
    ])
    return now


def test_stats_on_a_known_table(db: Database) -> None:
    build_known_table(db.engine)
    s = queue.stats(db.engine)

    assert (s.ready, s.scheduled, s.running) == (4, 3, 2)
    assert s.oldest_pending_age is not None and 600 <= s.oldest_pending_age < 630
    by_queue = {q.queue: q for q in s.queues}
    assert set(by_queue) == {"default", "mail"}
    d, m = by_queue["default"], by_queue["mail"]
    assert (d.ready, d.scheduled, d.running, d.expired_leases) == (3, 3, 2, 1)
    assert d.oldest_pending_age is not None and 600 <= d.oldest_pending_age < 630
    assert (m.ready, m.scheduled, m.running) == (1, 0, 0)
    assert m.oldest_pending_age is not None and 30 <= m.oldest_pending_age < 60

    assert {k: (v.total, v.recent) for k, v in s.dead_by_kind.items()} == {"a": (2, 1), "b": (1, 1)}
    assert s.dead_total == 3
    # Pending after a failure (running jobs with attempts are not waiting for a retry).
    assert s.retrying == {"noop": 1, "a": 1} and s.retrying_total == 2

    a, b = s.run_time_by_kind["a"], s.run_time_by_kind["b"]
    assert set(s.run_time_by_kind) == {"a", "b"}
    assert a.count == 5
    assert a.mean == pytest.approx(4.0, abs=1e-3)
    assert a.p50 == pytest.approx(3.0, abs=1e-3)
    assert a.p95 == pytest.approx(8.8, abs=1e-3)  # percentile_cont: 4 + 0.8 * (10 - 4)
    assert a.max == pytest.approx(10.0, abs=1e-3)
    assert (b.count, b.p50, b.p95, b.max) == (1, pytest.approx(0.5, abs=1e-3), pytest.approx(0.5, abs=1e-3),
                                              pytest.approx(0.5, abs=1e-3))
    assert s.finished == 6
    assert s.throughput == pytest.approx(6 / 60)
    assert a.per_minute == pytest.approx(5 / 60)

    # A three-hour window takes in the 100 s run finished two hours ago, and the old dead letter.
    wide = queue.stats(db.engine, window=3 * 3600)
    assert wide.run_time_by_kind["a"].count == 6
    assert wide.run_time_by_kind["a"].max == pytest.approx(100.0, abs=1e-3)
    assert wide.dead_by_kind["a"].recent == 2

    cheap = queue.stats(db.engine, run_times=False)
    assert (cheap.ready, cheap.running, cheap.run_times, cheap.dead_total) == (4, 2, [], 3)


def test_blocked_jobs_are_counted_per_queue(db: Database) -> None:
    """Jobs waiting for the jobs they depend on are a state of their own: neither ready nor scheduled."""
    with Session(db.engine) as session, session.begin():
        upstream = Job(kind="noop", payload={})
        session.add_all([Job(kind="noop", payload={}, depends_on=[upstream]),
                         *(Job(kind="noop", payload={}, queue="graphs", depends_on=[upstream]) for _ in range(2))])
    s = queue.stats(db.engine)
    assert (s.ready, s.scheduled, s.running, s.blocked) == (1, 0, 0, 3)
    by_queue = {q.queue: q for q in s.queues}
    assert (by_queue["default"].ready, by_queue["default"].blocked) == (1, 1)
    assert (by_queue["graphs"].ready, by_queue["graphs"].blocked) == (0, 2)  # a queue of blocked jobs only is listed
    assert s.to_dict()["blocked"] == 3 and s.to_dict()["queues"][1]["blocked"] == 2
    assert queue.stats(db.engine, run_times=False).blocked == 3


def test_stats_of_an_empty_table(db: Database) -> None:
    s = queue.stats(db.engine)
    assert (s.ready, s.scheduled, s.running, s.finished, s.dead_total, s.retrying_total) == (0, 0, 0, 0, 0, 0)
    assert s.blocked == 0
    assert s.oldest_pending_age is None and s.queues == [] and s.run_times == []
    assert s.to_dict()["oldest_pending_age"] is None


def test_only_scheduled_jobs_have_no_oldest_age(db: Database) -> None:
    """A job due tomorrow is not late today: the age counts from run_at, not created_at."""
    now = db_now(db.engine)
    add_jobs(db.engine, [{"run_at": now + timedelta(hours=1), "created_at": now - timedelta(days=3)}])
    s = queue.stats(db.engine)
    assert (s.ready, s.scheduled, s.oldest_pending_age) == (0, 1, None)


def test_stats_accepts_session_engine_and_connection(db: Database) -> None:
    add_jobs(db.engine, [{"run_at": db_now(db.engine) - timedelta(seconds=1)}])
    with Session(db.engine) as session:
        assert queue.stats(session).ready == 1
    with db.engine.connect() as conn:
        assert queue.stats(conn).ready == 1
    with pytest.raises(ConfigError):
        queue.stats("not a bind")  # type: ignore[arg-type]


def _plan(conn: Connection, stmt: Any) -> str:
    compiled = stmt.compile(conn, compile_kwargs={"literal_binds": True})
    return "\n".join(r[0] for r in conn.execute(text(f"EXPLAIN {compiled}")))


def test_stats_queries_can_use_the_partial_indexes(pg: Database) -> None:
    """With sequential scans priced out, every stats query still plans on its partial index.

    That proves each WHERE clause implies the index's predicate; on a big
    table the planner then picks the index by itself (see docs/howto/monitoring.md).
    """
    queue.create_tables(pg.engine)
    sql = queue.driver(pg.engine)
    with pg.engine.connect() as conn:
        conn.execute(text("SET enable_seqscan = off"))
        captured: list[Any] = []
        real_execute = conn.execute

        def capture(stmt: Any, *args: Any, **kw: Any) -> Any:
            captured.append(stmt)
            return real_execute(stmt, *args, **kw)

        conn.execute = capture  # type: ignore[method-assign]
        sql.pending_by_queue(conn)
        sql.running_by_queue(conn)
        sql.run_times(conn, 3600)
        sql.blocked_by_queue(conn)
        conn.execute = real_execute  # type: ignore[method-assign]
        plans = [_plan(conn, stmt) for stmt in captured]
        prune_plan = _plan(conn, select(Job.id).where(
            Job.finished_at < sql.ago(60), Job.finished_at.is_not(None), Job.state.in_(("finished", "cancelled"))
        ).order_by(Job.finished_at).limit(10))
    # pending by queue: the claim's partial index, or the fair claim's (its leading column is the queue)
    assert "ix_jobs_pending" in plans[0] or "ix_jobs_fair" in plans[0], plans[0]
    assert "ix_jobs_running" in plans[1], plans[1]
    assert "ix_jobs_finished" in plans[2], plans[2]
    assert "ix_jobs_blocked" in plans[3], plans[3]
    assert "ix_jobs_finished" in prune_plan, prune_plan


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.floats(min_value=0, max_value=1e5, allow_nan=False), min_size=1, max_size=40),
       st.sampled_from([0.0, 0.05, 0.5, 0.95, 1.0]))
def test_python_percentile_matches_postgres_percentile_cont(pg: Database, values: list[float], q: float) -> None:
    """SQLite's figures are computed in Python; they must equal PostgreSQL's for the same runs."""
    with pg.engine.connect() as conn:
        expected = conn.execute(
            text("SELECT percentile_cont(:q) WITHIN GROUP (ORDER BY v) FROM unnest(CAST(:vs AS float8[])) AS v"),
            {"q": q, "vs": values},
        ).scalar()
    assert percentile(sorted(values), q) == pytest.approx(expected, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize(("text_", "seconds"), [
    ("90s", 90), ("15m", 900), ("12h", 43200), ("30d", 2592000), ("1h30m", 5400), ("2w", 1209600),
    ("250ms", 0.25), ("45", 45), (" 7D ", 604800), (0, 0), (1.5, 1.5),
])
def test_parse_duration(text_: Any, seconds: float) -> None:
    assert parse_duration(text_) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "soon", "5x", "-5m", "m", "1h 30", "nan", "inf", -1])
def test_parse_duration_rejects_with_an_example(bad: Any) -> None:
    with pytest.raises(ConfigError, match="duration"):
        parse_duration(bad)


def test_format_duration() -> None:
    assert [format_duration(x) for x in (None, 0.25, 4.25, 42, 903, 7500, 273600)] == [
        "-", "250ms", "4.2s", "42s", "15m 3s", "2h 5m", "3d 4h"]
