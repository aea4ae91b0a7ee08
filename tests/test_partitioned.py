"""PostgreSQL's partitioned mode (sqla_jobs/drivers/postgresql/partitions.py), end to end.

The driver conformance suite (tests/drivers/) runs on a partitioned table too
(``postgresql-partitioned`` in ``tests.conftest.MODES``); these tests cover
what only this mode has: rows moving out of ``_live``, unique keys kept by a
finished holder in another partition, retention by whole days, the leader
making the coming days, and the two ways to create it.
"""

from __future__ import annotations

import importlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import date, datetime, timedelta, timezone
from inspect import signature
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, inspect, select, text, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from sqla_jobs import Worker
from sqla_jobs.drivers.postgresql import partitions as pg_partitions
from tests import app, forkserver
from tests import test_concurrency as concurrency
from tests.conftest import PG_URL, ROOT, Database, make_database, require_postgres, run_cli
from tests.test_migrations import Project, write_models

JOBS = app.Job.__table__


@pytest.fixture
def part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Database]:
    """A PostgreSQL schema whose jobs table was created partitioned, with the test app's other tables."""
    for database in make_database("postgresql-partitioned", tmp_path):
        monkeypatch.setenv("SQLA_JOBS_URL", database.url)
        app._engine = None
        app.queue.create_tables(database.engine, partitioned=True)
        app.Base.metadata.create_all(database.engine)  # effects, once: the jobs tables exist already
        yield database
        if app._engine is not None:
            app._engine.dispose()
            app._engine = None


def _today(db: Database) -> date:
    with db.engine.connect() as conn:
        return conn.execute(text("SELECT (now() AT TIME ZONE 'UTC')::date")).scalar_one()  # type: ignore[no-any-return]


def _count(db: Database, relation: str) -> int:
    with db.engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {relation}")).scalar_one())


def _days(db: Database) -> set[date]:
    with db.engine.connect() as conn:
        return set(pg_partitions.day_partitions(conn, JOBS))


def _burst(db: Database) -> None:
    Worker(db.engine, app.queue, concurrency=4, poll_interval=0.05).run(burst=True)


def test_the_table_is_partitioned_and_finished_jobs_leave_the_live_partition(part: Database) -> None:
    today = _today(part)
    assert _days(part) == {today + timedelta(days=n) for n in range(pg_partitions.DAYS_AHEAD + 1)}
    with Session(part.engine) as session, session.begin():
        session.add_all([app.Job(kind="noop", payload={"n": n}) for n in range(5)])
        session.add(app.Job(kind="fail", payload={}, max_attempts=1))
    assert _count(part, "jobs_live") == 6 and _count(part, "jobs_done") == 0
    _burst(part)
    assert _count(part, "jobs_live") == 0
    assert _count(part, f"jobs_done_{today:%Y%m%d}") == 5  # the failed one is in the dead-letter table
    # The user-facing model reads the parent as before: the ORM, get_job, list, stats.
    with Session(part.engine) as session:
        assert {j.state for j in session.scalars(select(app.Job))} == {"finished"}
        first = session.scalars(select(app.Job).order_by(app.Job.id)).first()
        assert first is not None and session.get(app.Job, first.id).finished_at is not None  # type: ignore[union-attr]
        assert app.queue.get_job(session, first.id).state == "finished"
        assert len(app.queue.list_jobs(session, state="finished")) == 5
    assert app.queue.stats(part.engine).run_times[0].count == 5
    out = run_cli("jobs", "list", "--state", "finished", "--app", "tests.app:queue", env=part.env())
    assert out.returncode == 0 and out.stdout.count("noop") == 5, out.stderr


def test_a_key_kept_while_finished_still_refuses_a_second_job_from_another_partition(part: Database) -> None:
    kept = ("pending", "running", "finished")
    with Session(part.engine) as session, session.begin():
        first = app.queue.enqueue_unique(session, "noop", {}, unique_key="k", unique_states=kept)
        loose = app.queue.enqueue_unique(session, "noop", {}, unique_key="loose")
    assert first.inserted and loose.inserted
    with Session(part.engine) as session, session.begin():  # a live holder: the live partition's unique index
        assert not app.queue.enqueue_unique(session, "noop", {}, unique_key="k", unique_states=kept).inserted
    _burst(part)
    assert _count(part, "jobs_live") == 0  # both holders moved to the done partitions
    with Session(part.engine) as session, session.begin():
        again = app.queue.enqueue_unique(session, "noop", {}, unique_key="k", unique_states=kept)
        free = app.queue.enqueue_unique(session, "noop", {}, unique_key="loose")
    assert not again.inserted and again.id == first.id  # the finished holder keeps its key
    assert free.inserted  # a key held while pending or running only is free once the job finished
    assert _count(part, "jobs_live") == 1


def test_prune_drops_the_days_past_the_cutoff_and_keeps_the_rest(part: Database) -> None:
    today = _today(part)
    old_day = today - timedelta(days=5)
    with part.engine.begin() as conn:
        assert pg_partitions.ensure_days(conn, JOBS, days_ahead=0, today=old_day) == [old_day]
    with Session(part.engine) as session, session.begin():
        session.add_all([app.Job(kind="noop", payload={}) for _ in range(7)])
    _burst(part)
    five_days_ago = datetime.combine(old_day, datetime.min.time(), timezone.utc) + timedelta(hours=12)
    with part.engine.begin() as conn:  # the first five finished five days ago: they move to that day
        conn.execute(update(JOBS).where(JOBS.c.id.in_(select(JOBS.c.id).order_by(JOBS.c.id).limit(5)))
                     .values(finished_at=five_days_ago))
    assert _count(part, f"jobs_done_{old_day:%Y%m%d}") == 5
    assert app.queue.prune(part.engine, older_than=6 * 86400) == 0  # the day is not past that cutoff yet
    assert old_day in _days(part)
    assert app.queue.prune(part.engine, older_than=2 * 86400) == 5
    assert old_day not in _days(part) and today in _days(part)
    assert _count(part, "jobs") == 2


def test_the_leader_makes_the_coming_days_and_the_worker_prunes_by_dropping(part: Database) -> None:
    today = _today(part)
    later = [today + timedelta(days=n) for n in range(1, pg_partitions.DAYS_AHEAD + 1)]
    with part.engine.begin() as conn:
        for day in later:
            conn.execute(text(f"DROP TABLE jobs_done_{day:%Y%m%d}"))
        pg_partitions.ensure_days(conn, JOBS, days_ahead=0, today=today - timedelta(days=3))
    assert _days(part) == {today, today - timedelta(days=3)}
    Worker(part.engine, app.queue, poll_interval=0.05, prune_after=86400).run(burst=True)
    # The worker counts the days from its own today: the next day's if midnight came during the run.
    expected = [{today, *(day + timedelta(days=n) for n in range(1, pg_partitions.DAYS_AHEAD + 1))}
                for day in sorted({today, _today(part)})]
    assert _days(part) in expected


def test_create_tables_partitioned_from_the_command_line(tmp_path: Path) -> None:
    for database in make_database("postgresql", tmp_path):
        out = run_cli("create-tables", "--partitioned", "--app", "tests.app:queue", env=database.env())
        assert out.returncode == 0, out.stderr
        with database.engine.connect() as conn:
            assert pg_partitions.is_partitioned(conn, JOBS)
            assert conn.execute(text("SELECT relkind FROM pg_class WHERE oid = 'jobs_live'::regclass")).scalar() == "r"
        again = run_cli("create-tables", "--partitioned", "--app", "tests.app:queue", env=database.env())
        assert again.returncode == 0, again.stderr  # idempotent
    url = f"sqlite:///{tmp_path / 'x.db'}"
    out = run_cli("create-tables", "--partitioned", "--app", "tests.app:queue", "--url", url)
    assert out.returncode == 2 and "no partitioned mode" in out.stderr


@pytest.mark.parametrize("flavour", ["threaded", "async"])
def test_several_worker_processes_run_every_job_exactly_once_on_a_partitioned_table(part: Database,
                                                                                    flavour: str) -> None:
    concurrency.test_four_worker_processes_run_every_job_exactly_once(part, flavour)
    assert _count(part, "jobs_live") == 0


def test_migrations_render_partitioned_creates_it_and_a_worker_uses_it(tmp_path: Path) -> None:
    for database in make_database("postgresql", tmp_path):
        project = Project(tmp_path / "proj", database)
        project.path.mkdir()
        write_models(project.path)
        project.sqla_jobs("migrations", "init", "migrations")
        ini = project.path / "alembic.ini"
        ini.write_text(ini.read_text().replace("sqla_jobs.app =", "sqla_jobs.app = jobmodels:queue"))
        out = project.sqla_jobs("migrations", "render", "--app", "jobmodels:queue", "--partitioned").stdout
        assert "partitioned by state" in out and "create table app_dead_tasks" in out
        project.alembic("upgrade", "head")
        engine = create_engine(database.url)
        with engine.connect() as conn:
            kind = conn.execute(text("SELECT relkind FROM pg_class WHERE oid = 'app_tasks'::regclass")).scalar()
            assert kind == "p"
        project.enqueue_and_work()  # the worker (the leader) makes today's partition first
        with engine.connect() as conn:
            live = conn.execute(text("SELECT count(*) FROM app_tasks_live")).scalar()
            days = conn.execute(text("SELECT count(*) FROM pg_inherits WHERE inhparent = 'app_tasks_done'::regclass"
                                     )).scalar()
        assert live == 0 and days == pg_partitions.DAYS_AHEAD + 2  # the days and DEFAULT
        # An upgrade compares the layout as the model has it: nothing to render, alembic check is clean.
        upgrade = project.sqla_jobs("migrations", "render", "--app", "jobmodels:queue", "--url", database.url)
        assert "up to date" in upgrade.stdout, upgrade.stdout
        project.check_clean()
        # On a database that has the table, --partitioned refuses: partitioning it is a data migration.
        twice = project.sqla_jobs("migrations", "render", "--app", "jobmodels:queue", "--partitioned",
                                  "--url", database.url, check=False)
        assert twice.returncode == 2 and "exists already" in twice.stderr
        project.alembic("downgrade", "base")
        assert not inspect(engine).has_table("app_tasks")
        engine.dispose()


#: Test modules of the user-facing surface whose ``test_x(db)`` functions run here on a partitioned table too.
_USER_FACING = ("test_dashboard", "test_stats", "test_operations", "test_unique", "test_periodic", "test_cli",
                "test_results", "test_cancel_running", "test_dead_letters")


def _db_tests() -> Iterator[object]:
    for name in _USER_FACING:
        module = importlib.import_module(f"tests.{name}")
        for attr, function in sorted(vars(module).items()):
            if attr.startswith("test_") and callable(function) and list(signature(function).parameters) == ["db"]:
                yield pytest.param(function, id=f"{name}.{attr}")


@pytest.mark.parametrize("user_test", list(_db_tests()))
def test_the_user_facing_tests_pass_on_a_partitioned_table(user_test: Callable[[Database], None],
                                                          part: Database) -> None:
    """Jobs, admin commands, stats, the dashboard, unique keys, periodic jobs: the plain table's own tests."""
    user_test(part)


def test_the_benchmark_script_runs(tmp_path: Path) -> None:
    """docs/bench/partitioned.py, small: both modes, and the prune removes every old row in each."""
    require_postgres()
    out = forkserver.run(
        [sys.executable, "docs/bench/partitioned.py", "--url", PG_URL, "--finished", "3000", "--jobs", "200",
         "--runs", "1", "--samples", "20", "--concurrency", "4", "--json", str(tmp_path / "r.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "| prune of the old rows, s |" in out.stdout
    results = json.loads((tmp_path / "r.json").read_text())
    assert results["plain"]["pruned"] == results["partitioned"]["pruned"] == 3000
    assert results["partitioned"]["after_prune"]["total_mb"] < results["partitioned"]["before"]["total_mb"]


def test_a_write_racing_a_move_to_another_partition_is_a_conflict_to_retry(part: Database) -> None:
    """What the how-to says: PostgreSQL fails (40001), not follows, a row a concurrent transaction moved."""
    driver = app.queue.driver(part.engine)
    with Session(part.engine) as session, session.begin():
        job = app.Job(kind="noop", payload={})
        session.add(job)
        session.flush()
        job_id = job.id
    errors: list[BaseException] = []
    with part.engine.connect() as mover:
        assert driver.cancel(mover, job_id) == (True, "pending")  # moves it to the done partition, uncommitted

        def retry() -> None:
            try:
                with driver.write(part.engine) as conn:
                    driver.retry_now(conn, job_id)  # waits for the mover's row lock
            except DBAPIError as exc:
                errors.append(exc)

        racer = threading.Thread(target=retry)
        racer.start()
        time.sleep(0.5)
        mover.commit()
        racer.join(30)
    assert len(errors) == 1 and driver.is_conflict(errors[0]), errors
    with Session(part.engine) as session:
        assert app.queue.get_job(session, job_id).state == "cancelled"


def test_cancelling_a_job_whose_run_finishes_meanwhile_is_too_late_not_a_conflict(part: Database) -> None:
    """``queue.cancel`` waits for a finish in flight that moves the row to the done partition: it must report
    the job finished (too late), as on a plain table, not raise the serialization failure of the move."""
    from sqla_jobs import JobStateError

    with Session(part.engine) as session, session.begin():
        job = app.Job(kind="noop", payload={})
        session.add(job)
        session.flush()
        job_id = job.id
    with part.engine.begin() as conn:  # a worker's claim, committed
        conn.execute(update(JOBS).where(JOBS.c.id == job_id).values(state="running", claim_token="t", attempts=1))
    outcome: list[object] = []
    with part.engine.connect() as finisher:
        finisher.execute(update(JOBS).where(JOBS.c.id == job_id)  # the finish, in flight: the row moves
                         .values(state="finished", finished_at=func.now()))

        def cancel() -> None:
            try:
                with Session(part.engine) as session, session.begin():
                    outcome.append(app.queue.cancel(session, job_id))  # waits for the finisher's row lock
            except BaseException as exc:  # reported, whatever it was
                outcome.append(exc)

        canceller = threading.Thread(target=cancel)
        canceller.start()
        time.sleep(0.5)
        finisher.commit()
        canceller.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], JobStateError), outcome
    assert "finished already" in str(outcome[0])


def test_a_day_whose_rows_are_in_default_is_skipped_and_pruned_there_by_age(part: Database) -> None:
    today = _today(part)
    later = today + timedelta(days=2)
    with Session(part.engine) as session, session.begin():
        session.add_all([app.Job(kind="noop", payload={}) for _ in range(2)])
    _burst(part)
    with part.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE jobs_done_{later:%Y%m%d}"))
    noon = datetime.combine(later, datetime.min.time(), timezone.utc) + timedelta(hours=12)
    with part.engine.begin() as conn:  # a clock that ran ahead, or a leader away: the row lands in DEFAULT
        conn.execute(update(JOBS).where(JOBS.c.id == select(func.min(JOBS.c.id)).scalar_subquery())
                     .values(finished_at=noon))
    assert _count(part, "jobs_done_default") == 1
    with part.engine.begin() as conn:
        assert pg_partitions.ensure_days(conn, JOBS) == []  # that day cannot be made; no error either
    assert later not in _days(part)
    assert app.queue.prune(part.engine, older_than=0) == 0  # DEFAULT is pruned by age: that row is not old
    with part.engine.begin() as conn:
        conn.execute(update(JOBS).where(JOBS.c.finished_at == noon).values(finished_at=noon - timedelta(days=9)))
    assert _count(part, "jobs_done_default") == 1
    assert app.queue.prune(part.engine, older_than=86400) == 1
    assert _count(part, "jobs_done_default") == 0 and _count(part, "jobs") == 1
