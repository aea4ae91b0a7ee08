"""PostgreSQL: the claim reads the pending index in claim order, whatever the table's statistics say.

When the table's statistics do not know about a backlog (a young table has
none; stale ones saw an idle queue), the default planner may read every
pending row and sort them all to lock a batch: each claim costs O(backlog), and
a backlog drains ever more slowly the larger it is (issue 11). Behind PgBouncer
(``prepare_threshold=none``) every claim is planned that way. PostgreSQL reports the plan
it ran through auto_explain, which these tests ask for on their own connection.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from sqlalchemy import Connection

from tests import app
from tests.conftest import Database

BACKLOG = 30_000


def enqueue_backlog(db: Database) -> None:
    driver = app.queue.driver(db.engine)
    rows = [{"kind": "noop", "queue": "default", "payload": json.dumps({}), "priority": 0, "max_attempts": 5,
             "run_at": None} for _ in range(BACKLOG)]
    with driver.write(db.engine) as conn:
        driver.insert_many(conn, rows)  # no ANALYZE afterwards, as after a burst on a young table


def explain_what_runs(conn: Connection) -> list[str]:
    """Every statement ``conn`` runs from now on comes back to us with its plan, as a server message."""
    plans: list[str] = []
    conn.connection.driver_connection.add_notice_handler(  # type: ignore[union-attr]
        lambda diag: plans.append(diag.message_primary or ""))
    for setting in ("LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
                    "SET auto_explain.log_analyze = on", "SET client_min_messages = log"):
        conn.exec_driver_sql(setting)
    return plans


def claim(conn: Connection, limit: int) -> Any:
    driver = app.queue.driver(conn)
    jobs, _ = driver.claim_batch(conn, limit, "plan-test", uuid.uuid4().hex, 60.0, None, False)
    conn.commit()
    return jobs


@pytest.mark.parametrize("autocommit", [True, False], ids=["the worker's autocommit connection", "a transaction"])
def test_the_claim_walks_the_pending_index_with_a_backlog_the_statistics_do_not_know(
    pg: Database, autocommit: bool
) -> None:
    """A young table, never analyzed, then a backlog: by default PostgreSQL expects a few pending rows,
    reads all 30,000 through a bitmap scan and sorts them, to lock 64 (the drain's first claims)."""
    app.queue.create_tables(pg.engine)
    enqueue_backlog(pg)
    with pg.engine.connect() as conn:
        plans = explain_what_runs(conn)
        conn.commit()
        if autocommit:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        jobs = claim(conn, 64)
    assert len(jobs) == 64
    (plan,) = [p for p in plans if "CTE due" in p]
    due = plan[plan.index("CTE due"):plan.index("CTE alone")]
    assert "Index Scan using ix_jobs_pending" in due, due
    assert "Bitmap" not in due and "Sort" not in due, due  # not every pending row, read and sorted
    assert "rows=64 loops=1" in due.split("LockRows")[1].splitlines()[0]  # it stopped at the limit


def test_the_planner_settings_end_with_the_claim(pg: Database) -> None:
    """The claim's settings are its transaction's alone: the connection plans as before afterwards, the
    user's own settings included (behind PgBouncer a session setting would reach other clients)."""
    app.queue.create_tables(pg.engine)
    enqueue_backlog(pg)

    def settings(conn: Connection) -> tuple[str, str]:
        return (conn.exec_driver_sql("SHOW enable_bitmapscan").scalar(),
                conn.exec_driver_sql("SHOW enable_seqscan").scalar())

    with pg.engine.connect() as conn:
        hot = conn.execution_options(isolation_level="AUTOCOMMIT")
        assert len(claim(hot, 5)) == 5
        assert settings(hot) == ("on", "on")
    with pg.engine.connect() as conn:
        conn.exec_driver_sql("SET enable_seqscan = off")  # the user's, for the session
        driver = app.queue.driver(conn)
        jobs, _ = driver.claim_batch(conn, 5, "plan-test", uuid.uuid4().hex, 60.0, None, False)
        assert len(jobs) == 5
        assert settings(conn) == ("on", "off")  # inside the same transaction: as they were before the claim
        conn.commit()
        assert settings(conn) == ("on", "off")
        conn.exec_driver_sql("RESET enable_seqscan")
        conn.commit()
