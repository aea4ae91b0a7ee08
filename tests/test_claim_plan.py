"""The claim reads the pending index in claim order: on PostgreSQL whatever the table's statistics say, on
MariaDB (no partial indexes) past a million finished rows.

When the table's statistics do not know about a backlog (a young table has
none; stale ones saw an idle queue), the default planner may read every
pending row and sort them all to lock a batch: each claim costs O(backlog), and
a backlog drains ever more slowly the larger it is (issue 11). Behind PgBouncer
(``prepare_threshold=none``) every claim is planned that way. PostgreSQL reports the plan
it ran through auto_explain, which these tests ask for on their own connection.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Connection, event

from tests import app
from tests.conftest import Database

BACKLOG = 30_000


def enqueue_backlog(db: Database, jobs: int = BACKLOG) -> None:
    driver = app.queue.driver(db.engine)
    rows = [{"kind": "noop", "queue": "default", "payload": json.dumps({}), "priority": 0, "max_attempts": 5,
             "run_at": None} for _ in range(jobs)]
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


def claim(conn: Connection, limit: int, queues: list[str] | None = None) -> Any:
    driver = app.queue.driver(conn)
    jobs, _ = driver.claim_batch(conn, limit, "plan-test", uuid.uuid4().hex, 60.0, queues, False)
    conn.commit()
    return jobs


@pytest.mark.parametrize("autocommit", [True, False], ids=["the worker's autocommit connection", "a transaction"])
@pytest.mark.parametrize(("queues", "limit"), [(None, 64), (None, 1000), (["default"], 1000)],
                         ids=["every queue", "every queue, a large batch", "named queues, a large batch"])
def test_the_claim_walks_the_pending_index_with_a_backlog_the_statistics_do_not_know(
    pg: Database, autocommit: bool, queues: list[str] | None, limit: int
) -> None:
    """A young table, never analyzed, then a backlog: by default PostgreSQL expects a few pending rows,
    reads all 30,000 through a bitmap scan and sorts them, to lock 64 (the drain's first claims). A worker of
    named queues (``--queue``, the relay) was read all its queue's jobs along ``ix_jobs_fair``, led by the queue,
    and sorted them: 23 ms a claim of 1,000 at 40,000 pending jobs, the relay to NATS a third slower."""
    app.queue.create_tables(pg.engine)
    enqueue_backlog(pg)
    with pg.engine.connect() as conn:
        plans = explain_what_runs(conn)
        conn.commit()
        if autocommit:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        for _ in range(7):  # past psycopg's 5th run, which prepares the statement: then its generic plan may run
            jobs = claim(conn, limit, queues)
    assert len(jobs) == limit
    plan = [p for p in plans if "CTE due" in p][-1]
    due = plan[plan.index("CTE due"):plan.index("CTE alone")]
    assert "Index Scan using ix_jobs_pending" in due, due
    assert "Bitmap" not in due and "Sort" not in due, due  # not every pending row, read and sorted
    assert f"rows={limit} loops=1" in due.split("LockRows")[1].splitlines()[0]  # it stopped at the limit


def test_the_planner_settings_end_with_the_claim(pg: Database) -> None:
    """The claim's settings are its transaction's alone: the connection plans as before afterwards, the
    user's own settings included (behind PgBouncer a session setting would reach other clients)."""
    app.queue.create_tables(pg.engine)
    enqueue_backlog(pg)

    def settings(conn: Connection) -> tuple[str, ...]:
        return tuple(conn.exec_driver_sql(f"SHOW {name}").scalar()
                     for name in ("enable_bitmapscan", "enable_seqscan", "jit", "enable_sort"))

    with pg.engine.connect() as conn:
        hot = conn.execution_options(isolation_level="AUTOCOMMIT")
        assert len(claim(hot, 5)) == 5
        assert settings(hot) == ("on", "on", "on", "on")
    with pg.engine.connect() as conn:
        conn.exec_driver_sql("SET enable_seqscan = off")  # the user's, for the session
        driver = app.queue.driver(conn)
        jobs, _ = driver.claim_batch(conn, 5, "plan-test", uuid.uuid4().hex, 60.0, None, False)
        assert len(jobs) == 5
        assert settings(conn) == ("on", "off", "on", "on")  # inside the same transaction: as before the claim
        conn.commit()
        assert settings(conn) == ("on", "off", "on", "on")
        conn.exec_driver_sql("RESET enable_seqscan")
        conn.commit()



@pytest.mark.parametrize("autocommit", [True, False], ids=["the worker's autocommit connection", "a transaction"])
def test_the_hand_off_after_the_claim_is_planned_with_the_connections_settings(pg: Database, autocommit: bool) -> None:
    """The count-down of a finished job's dependents runs in the claim's transaction, after it (handoff.py), and
    must not inherit the claim's planner settings: without sorts the root of a fan-out of 100,000 hashed its
    dependents' edges to disk and updated them in hash order (1.9 s against 1.2; the fan-out bench 0.47 of the
    plain drain against 0.64)."""
    from sqlalchemy.orm import Session

    app.queue.create_tables(pg.engine)
    with Session(pg.engine, expire_on_commit=False) as session, session.begin():
        root = app.Job(kind="noop", payload={})
        session.add_all([root, *(app.Job(kind="noop", payload={"i": i}, depends_on=[root]) for i in range(3))])
    with pg.engine.connect() as conn:
        plans = explain_what_runs(conn)
        conn.exec_driver_sql("SET auto_explain.log_settings = on")  # a plan names each planner setting changed
        conn.commit()
        if autocommit:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        driver = app.queue.driver(conn)
        token = uuid.uuid4().hex
        (claimed,), _ = driver.claim_batch(conn, 1, "plan-test", token, 60.0, None, False)
        assert claimed.id == root.id and claimed.has_dependents
        driver.finish_and_claim(conn, [(root.id, token)], 0, "plan-test", token, 60.0, None, upstreams=[root.id])
        conn.commit()
    claim = [p for p in plans if "CTE due" in p][-1]
    assert "enable_sort = 'off'" in claim, claim  # the claim's own settings, as the test above needs them
    (handoff,) = [p for p in plans if "CTE counted" in p]
    assert "enable_sort" not in handoff and "enable_seqscan" not in handoff, handoff
    with pg.engine.connect() as conn:
        states = conn.exec_driver_sql("SELECT state, count(*) FROM jobs GROUP BY state").all()
    assert sorted(states) == [("finished", 1), ("pending", 3)]

def add_fair_jobs(conn: Connection, key: str, rows: int) -> None:
    """``rows`` pending jobs of queue ``fair``, each keyed by the SQL expression ``key`` of ``i`` (0, 1, ...)."""
    conn.exec_driver_sql("INSERT INTO jobs (kind, queue, payload, fair_key) "
                         f"SELECT 'noop', 'fair', '{{}}', {key} FROM generate_series(0, {rows - 1}) AS i")


def claim_fair(conn: Connection, cursor: str = "") -> tuple[Any, bool, str]:
    """A fair claim of 16 from queue ``fair`` (tests.fair_app), after ``cursor``, on ``conn``."""
    from tests import fair_app

    return fair_app.queue.driver(conn).claim_fair(conn, "fair", {}, cursor, 16, "plan-test", uuid.uuid4().hex,
                                                  60.0, False)


def big_tenant_claim(pg: Database, small: str, rows: int) -> tuple[Any, str]:
    """Tenant A's 100,000 pending jobs and ``rows`` more keyed by ``small`` (see ``add_fair_jobs``), analyzed;
    then one fair claim: its jobs and the plan it ran by."""
    app.queue.create_tables(pg.engine)
    with pg.engine.begin() as conn:
        add_fair_jobs(conn, "'A'", 100_000)
        add_fair_jobs(conn, small, rows)
        conn.exec_driver_sql("ANALYZE jobs")
    with pg.engine.connect() as conn:
        plans = explain_what_runs(conn)
        conn.commit()
        jobs, _, _ = claim_fair(conn.execution_options(isolation_level="AUTOCOMMIT"))
    (plan,) = [p for p in plans if "CTE walk" in p]
    return jobs, plan


def most_rows_read(plan: str) -> int:
    """The most rows any node of an auto_explain ``plan`` read, over all its loops."""
    return max(int(rows) * int(loops) for rows, loops in re.findall(r"actual time=\S+ rows=(\d+) loops=(\d+)", plan))


def test_a_fair_claim_reads_a_few_rows_on_a_table_its_statistics_know(pg: Database) -> None:
    """Autovacuum's ANALYZE has seen tenant A's 100,000 pending jobs: the fair claim's lateral LIMITs are
    expressions, so the planner guesses it takes thousands of rows, and it hashed the whole primary key to
    update 16 (180 ms a claim at 100,000 jobs) and compiled the statement with JIT (2 s a claim). Every node of
    the plan that ran reads a few dozen rows at most, and nothing is compiled."""
    jobs, plan = big_tenant_claim(pg, "chr(66 + i)", 10)
    assert len(jobs) == 16
    assert "JIT" not in plan, plan
    assert most_rows_read(plan) <= 64, plan  # 16 claimed, 17 locked of A's, the walk's 11 keys


def test_a_big_key_beside_a_small_one_fills_the_fair_claim_in_one_probe(pg: Database) -> None:
    """Tenant A with 100,000 pending jobs, tenant B with one: A's turn takes the rest of the claim at once, so
    the top-up (``extra``: a second probe of A's jobs, which each such claim made) does not run."""
    jobs, plan = big_tenant_claim(pg, "'B'", 1)
    extra = plan[plan.index("CTE extra"):plan.index("CTE due")]
    assert len(jobs) == 16 and extra.count("LockRows") == 2, plan
    assert all("never executed" in line for line in extra.splitlines() if "LockRows" in line), extra


def test_the_fair_ring_wraps_to_a_big_key_without_walking_its_claimed_jobs(pg: Database) -> None:
    """Tenant A alone, 20,000 of its 30,000 jobs claimed and not yet vacuumed: their entries stay first in A's
    range of ix_jobs_fair. A worker that served A last wraps the ring back to A; finding the lowest key with a
    pending job walked all 20,000 (150 pages, at every claim of a big tenant's drain), where A's own turn then
    walks them once anyway. The walk now reads a few pages."""
    app.queue.create_tables(pg.engine)
    with pg.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE jobs SET (autovacuum_enabled = false)")  # the entries stay, as between
        add_fair_jobs(conn, "'A'", 30_000)                                          # two of autovacuum's rounds
        conn.exec_driver_sql("UPDATE jobs SET state = 'running' WHERE id <= (SELECT min(id) + 19999 FROM jobs)")
        conn.exec_driver_sql("ANALYZE jobs")
    with pg.engine.connect() as conn:
        hot = conn.execution_options(isolation_level="AUTOCOMMIT")
        claim_fair(hot, "A")  # once, so that the claimed jobs' entries are known dead, as in a drain
        plans = explain_what_runs(hot)
        hot.exec_driver_sql("SET auto_explain.log_buffers = on")
        jobs, _, cursor = claim_fair(hot, "A")
    assert len(jobs) == 16 and cursor == "A"
    (plan,) = [p for p in plans if "CTE walk" in p]
    walk = plan[plan.index("CTE walk"):plan.index("CTE slots")]
    pages = int(re.findall(r"Buffers: shared hit=(\d+)", walk)[0])  # the whole walk's (its first node's)
    assert pages <= 20, walk


class KnownLimit(Exception):
    """What the strict xfail below expects, and nothing else: any other failure of its test is a real one."""


@pytest.mark.xfail(strict=True, raises=KnownLimit, reason="a known limit (docs/performance.md, 'Fair queues', the "
                   "side finding): the two lookups tried cost the common drain more than this case gains")
@pytest.mark.parametrize("fair", [True, False], ids=["fair", "plain"])
def test_the_hot_statements_finish_looks_up_its_jobs_whatever_else_runs(pg: Database, fair: bool) -> None:
    """The statistics were taken with nothing running, then 20,000 jobs started (other workers' long runs): the
    hot statement's generic plan, guessing one running row, reads every running job to match the few the
    claimer finishes, at every claim (16 ms a claim). Wanted: every node reads a few dozen rows at most."""
    from tests import fair_app

    app.queue.create_tables(pg.engine)
    with pg.engine.begin() as conn:
        add_fair_jobs(conn, "chr(65 + i %% 11)", 30_000)
        if not fair:
            conn.exec_driver_sql("UPDATE jobs SET queue = 'default'")
        conn.exec_driver_sql("ANALYZE jobs")
        conn.exec_driver_sql("UPDATE jobs SET state = 'running', claim_token = 'other' "
                             "WHERE id <= (SELECT min(id) + 19999 FROM jobs)")
    driver = (fair_app if fair else app).queue.driver(pg.engine)
    with pg.engine.connect() as conn:
        hot = conn.execution_options(isolation_level="AUTOCOMMIT")
        cursor, fences = "", []
        for turn in range(9):  # psycopg prepares them on their 6th run
            if turn == 8:
                plans = explain_what_runs(hot)
            if fair:
                finished, jobs, _, cursor = driver.finish_and_claim_fair(
                    hot, fences, "fair", {}, cursor, 16, "plan-test", uuid.uuid4().hex, 60.0, False)
            else:
                finished, jobs, _ = driver.finish_and_claim(hot, fences, 16, "plan-test", uuid.uuid4().hex, 60.0,
                                                            None)
            assert finished == {fence[0] for fence in fences} and len(jobs) == 16
            fences = [job.fence for job in jobs]
    (plan,) = [p for p in plans if "FOR UPDATE" in p or "LockRows" in p]
    if most_rows_read(plan) > 64:
        raise KnownLimit(plan)


def test_the_fair_claim_is_sent_with_postgresqls_own_parameters() -> None:
    """psycopg parses a ``%(name)s`` statement of over 4,096 characters anew at each execute (the fair claim:
    6,000); ``Positional`` turns it into ``$n`` once, each name one number, and orders the values to match."""
    from sqla_jobs.drivers.postgresql.claim import Positional
    from sqla_jobs.drivers.postgresql.fair import FINISH, fair_claim_sql

    stmt = Positional("SELECT %(a)s, %(b)s::text[], %(a)s + 1")
    assert stmt.sql == "SELECT $1, $2::text[], $1 + 1"
    assert stmt.values({"b": ["x"], "a": 2, "unused": 0}) == [2, ["x"]]
    fair = Positional(fair_claim_sql("jobs", FINISH[False].format(table="jobs")))
    assert "%(" not in fair.sql and len(fair.sql) > 4096
    assert sorted(fair.names) == sorted(set(fair.names)) and "queue" in fair.names


def test_a_fair_claim_is_planned_once_per_connection(pg: Database) -> None:
    """Making the fair claim's custom plan took twice as long as running it, and PostgreSQL kept making one a
    claim (its generic plan's estimates look dear): once psycopg has prepared the statement, the claim runs
    its generic plan, and the setting that says so ends with the claim's transaction."""
    app.queue.create_tables(pg.engine)
    with pg.engine.begin() as conn:
        add_fair_jobs(conn, "chr(65 + i %% 11)", 3000)
        conn.exec_driver_sql("ANALYZE jobs")
    with pg.engine.connect() as conn:
        hot = conn.execution_options(isolation_level="AUTOCOMMIT")
        cursor = ""
        for _ in range(20):
            jobs, _, cursor = claim_fair(hot, cursor)
            assert len(jobs) == 16
        generic, custom = hot.exec_driver_sql(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE '%%walk%%'").one()
        assert (generic, custom) == (15, 0)  # psycopg prepares it on its 6th run
        assert hot.exec_driver_sql("SHOW plan_cache_mode").scalar() == "auto"
    with pg.engine.connect() as conn:  # inside the caller's transaction too, the setting is put back after it
        assert len(claim_fair(conn, cursor)[0])
        assert conn.in_transaction() and conn.exec_driver_sql("SHOW plan_cache_mode").scalar() == "auto"
        conn.rollback()


def test_a_fair_claims_generic_plan_takes_each_turn_on_the_fair_index(pg: Database) -> None:
    """Tenant A holds 30,000 jobs, ten small tenants came after the statistics were taken (50 each): the
    prepared claim's generic plan took each small key's turn on ix_jobs_pending, walking past A's jobs (0.5 s
    a claim), the planner having dropped the key, equal to a value, from the turn's ORDER BY. Every node of
    the plan the prepared claim runs reads a few dozen rows at most."""
    app.queue.create_tables(pg.engine)
    with pg.engine.begin() as conn:
        add_fair_jobs(conn, "'A'", 30_000)
        conn.exec_driver_sql("ANALYZE jobs")  # before the small tenants came: to the statistics, every job is A's
        add_fair_jobs(conn, "chr(66 + i %% 10)", 500)
    with pg.engine.connect() as conn:
        hot = conn.execution_options(isolation_level="AUTOCOMMIT")
        cursor = ""
        for _ in range(8):  # psycopg prepares it on its 6th run
            cursor = claim_fair(hot, cursor)[2]
        plans = explain_what_runs(hot)
        jobs, _, _ = claim_fair(hot, cursor)
    assert len(jobs) == 16
    (plan,) = [p for p in plans if "CTE walk" in p]
    assert "ix_jobs_pending" not in plan, plan
    assert most_rows_read(plan) <= 64, plan


def mariadb_plan(db: Database, call: Callable[[Connection], Any], marker: str) -> tuple[Any, dict[str, Any]]:
    """Run ``call`` on a connection to ``db`` (rolled back after), then the statement it sent that contains
    ``marker`` again under ``ANALYZE FORMAT=JSON``: ``call``'s result and the plan MariaDB really ran."""
    sent: list[tuple[str, Any]] = []

    def keep(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        sent.append((statement, parameters))

    with db.engine.connect() as conn:
        event.listen(conn, "before_cursor_execute", keep)
        result = call(conn)
        event.remove(conn, "before_cursor_execute", keep)
        conn.rollback()
    statement, params = next((s, p) for s, p in sent if marker in s)
    with db.engine.connect() as conn:
        analyzed = json.loads(conn.exec_driver_sql("ANALYZE FORMAT=JSON " + statement, params).scalar_one())
        conn.rollback()
    return result, analyzed


def test_mariadb_claims_by_an_index_range_with_a_million_finished_rows(mariadb: Database) -> None:
    """MariaDB has no partial index: the claim's index leads with ``state``, so the claim reads the pending
    range in claim order and never the finished rows (issue 15, docs/howto/backends.md). The statement is the
    one ``claim_batch`` sends, run again under ``ANALYZE``: the plan MariaDB really ran, with its row counts."""
    driver = app.queue.driver(mariadb.engine)
    with driver.write(mariadb.engine) as conn:
        driver.bench_fill_finished(conn, 1_000_000)
    enqueue_backlog(mariadb, 1000)
    with mariadb.engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE TABLE jobs")
    (jobs, _), analyzed = mariadb_plan(
        mariadb, lambda conn: driver.claim_batch(conn, 10, "plan-test", uuid.uuid4().hex, 60.0, None, False),
        "SKIP LOCKED")
    assert len(jobs) == 10
    text = json.dumps(analyzed)
    (step,) = analyzed["query_block"]["nested_loop"]
    table = step["table"]
    assert table["key"] == "ix_jobs_pending" and "filesort" not in text, text
    assert table["r_rows"] <= 20, text  # the batch and a few more, never the finished million


def test_mariadb_takes_a_fair_keys_turn_in_index_order(mariadb: Database) -> None:
    """A fair queue's turn on MariaDB (drivers/_fair.py): tenant A holds 30,000 pending jobs; its turn reads the
    16 it takes on ``ix_jobs_fair`` in claim order. It sorted all 30,000 (filesort, 70 ms a turn: a fair drain of
    45 jobs/s) while its ORDER BY named the queue and key the WHERE fixes."""
    with mariadb.engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO jobs (kind, queue, payload, fair_key) VALUES ('noop', 'fair', '{}', 'A')")
        for _ in range(15):  # doubled on the server: 32,768 rows
            conn.exec_driver_sql("INSERT INTO jobs (kind, queue, payload, fair_key) "
                                 "SELECT kind, queue, payload, fair_key FROM jobs")
        conn.exec_driver_sql("ANALYZE TABLE jobs")
    (jobs, _, _), analyzed = mariadb_plan(mariadb, claim_fair, "SKIP LOCKED")
    assert len(jobs) == 16
    text = json.dumps(analyzed)
    assert "filesort" not in text and '"key": "ix_jobs_fair"' in text, text
    (step,) = analyzed["query_block"]["nested_loop"]
    assert step["table"]["r_rows"] <= 20, text  # the turn and one more, never the tenant's 32,768


def test_mariadb_takes_a_fair_claims_turns_in_one_statement(mariadb: Database) -> None:
    """With twelve keys pending, MariaDB's fair claim takes every key's turn in one statement (a UNION ALL of
    locking reads): it was a round trip per key. The claim still goes round the ring in order."""
    from tests import fair_app

    with mariadb.engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO jobs (kind, queue, payload, fair_key) "
                             "SELECT 'noop', 'fair', '{}', concat('k', lpad(seq %% 12, 2, '0')) FROM seq_1_to_120")
    driver = fair_app.queue.driver(mariadb.engine)
    sent: list[str] = []

    def keep(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        sent.append(statement)

    with mariadb.engine.connect() as conn:
        event.listen(conn, "before_cursor_execute", keep)
        jobs, _, cursor = driver.claim_fair(conn, "fair", {}, "k05", 12, "plan-test", uuid.uuid4().hex, 60.0, False)
        conn.commit()
    assert [j.id for j in jobs] and cursor == "k05"
    with mariadb.engine.connect() as conn:
        keys = [conn.exec_driver_sql(f"SELECT fair_key FROM jobs WHERE id = {j.id}").scalar() for j in jobs]
    assert keys == [f"k{n:02d}" for n in [*range(6, 12), *range(0, 6)]]  # the ring after the cursor, once round
    locking = [statement for statement in sent if "FOR UPDATE SKIP LOCKED" in statement]
    assert len(locking) == 1 and locking[0].count("UNION ALL") == 11, sent


def test_mariadb_locks_a_workers_running_jobs_by_primary_key(mariadb: Database) -> None:
    """A heartbeat (or a finish) locks the worker's running rows through the primary key, the order every
    other write takes them in. Reading them through the claim index (``state = 'running'`` is a small range
    there) locked that index's entries first: a handler's transaction finishing one of those jobs holds the
    row and needs its index entry, which the heartbeat holds while it waits for the row, and InnoDB broke
    the circle by rolling the handler's work back ("Deadlock found", a failed attempt for a committed job)."""
    driver = app.queue.driver(mariadb.engine)
    enqueue_backlog(mariadb, 1000)
    with mariadb.engine.connect() as conn:
        jobs, _ = driver.claim_batch(conn, 8, "plan-test", uuid.uuid4().hex, 60.0, None, False)
        conn.commit()
        conn.exec_driver_sql("ANALYZE TABLE jobs")
    held, analyzed = mariadb_plan(mariadb, lambda conn: driver.heartbeat(conn, [job.fence for job in jobs], 60.0),
                                  "FOR UPDATE")
    assert len(held) == 8
    (step,) = analyzed["query_block"]["nested_loop"]
    assert step["table"]["key"] == "PRIMARY", json.dumps(analyzed)


def test_mariadb_releases_a_dependent_through_its_edges_not_a_scan_of_the_table(mariadb: Database) -> None:
    """The finish of a batch of a fan-in's upstreams releases the dependents whose count reached 0. Written as
    ``id IN (their edges)``, MariaDB (no semi-join in a single-table UPDATE) read every row of the jobs table
    and ran the subquery for each: 34 ms a batch beside 20,000 jobs, a fan-in drained at half the plain rate.
    The statistics here say what a fan-in's enqueue left: most jobs blocked."""
    from sqlalchemy.orm import Session

    with Session(mariadb.engine, expire_on_commit=False) as session, session.begin():
        upstreams = [app.Job(kind="noop", payload={"i": i}) for i in range(2000)]
        join = app.Job(kind="noop", payload={}, depends_on=upstreams)
        dependents = [app.Job(kind="noop", payload={}, depends_on=[u]) for u in upstreams[:1500]]
        session.add_all([*upstreams, join, *dependents])
    with mariadb.engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE TABLE jobs")  # most rows blocked
        conn.exec_driver_sql(f"UPDATE jobs SET state = 'finished' WHERE id <= {upstreams[-1].id}")
    driver = app.queue.driver(mariadb.engine)
    batch = [u.id for u in upstreams[100:164]]
    touched, analyzed = mariadb_plan(mariadb, lambda conn: driver.unblock(conn, batch), "waiting_for <=")
    assert touched == 65  # the join, and the 64 one-upstream dependents of this batch
    text = json.dumps(analyzed)
    steps = analyzed["query_block"].get("nested_loop") or [analyzed["query_block"]]
    (jobs,) = [step["table"] for step in steps if step["table"]["table_name"] == "jobs"]
    assert jobs["r_rows"] * jobs.get("r_loops", 1) <= 70, text  # the released jobs, not the table's 3,501 rows
