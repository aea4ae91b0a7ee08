"""The plans of a bulk emit on PostgreSQL (``drivers/postgresql/durable.py``) when the tables' statistics are
older than the burst of parked jobs, as they are until autovacuum's ANALYZE comes round."""

from __future__ import annotations

from sqlalchemy.orm import Session

from tests import durable_app
from tests.conftest import Database
from tests.test_claim_plan import explain_what_runs, most_rows_read

WAITERS = 2000


def test_a_bulk_emit_finds_its_waiters_by_key_whatever_the_statistics_say(pg: Database) -> None:
    """2,000 jobs park waiting for an event each, in tables never analyzed, and one ``emit_events`` answers them
    all. The waiting jobs were joined to their waits, and the planner, guessing a handful of rows on each side,
    chose a nested loop: in the durable bench, over a materialized scan of the waits, 50 million row pairs for
    10,000 waiters (6 s a statement). Now neither statement has a join to misplan: the waits are read once
    into an array, and each job or wait is looked up by its key."""
    queue = durable_app.queue
    queue.create_tables(pg.engine)
    jobs, steps = queue.driver(pg.engine).jobs.name, queue.driver(pg.engine).steps.name
    with pg.engine.begin() as conn:
        conn.exec_driver_sql(
            f"INSERT INTO {jobs} (kind, queue, payload, state, run_at) SELECT 'd_wait', 'default', '{{}}', "
            f"'pending', now() + interval '1 day' FROM generate_series(1, {WAITERS})")
        conn.exec_driver_sql(
            f"INSERT INTO {steps} (job_id, name, awaiting, until, started_at) SELECT id, 'wait:1', 'k' || id, "
            f"now() + interval '1 day', now() FROM {jobs}")
    with pg.engine.connect() as conn:
        plans = explain_what_runs(conn)
        conn.commit()
        with Session(bind=conn) as session, session.begin():
            ids = [row[0] for row in conn.exec_driver_sql(f"SELECT id FROM {jobs}")]
            woken = queue.emit_events(session, {f"k{i}": {"n": i} for i in ids})
        conn.commit()  # the session joined the connection's transaction: it is the connection's to end
    assert woken == WAITERS
    updates = [plan for plan in plans if "Update on" in plan]
    assert len(updates) == 2, plans  # the waiting jobs made due, their waits answered
    for plan in updates:
        assert "Nested Loop" not in plan and "Join" not in plan, plan
        assert most_rows_read(plan) <= 3 * WAITERS, plan
    with pg.engine.connect() as conn:
        due = conn.exec_driver_sql(f"SELECT count(*) FROM {jobs} WHERE run_at <= now()").scalar()
        answered = conn.exec_driver_sql(f"SELECT count(*) FROM {steps} WHERE value IS NOT NULL "
                                        "AND finished_at IS NOT NULL").scalar()
    assert due == answered == WAITERS
