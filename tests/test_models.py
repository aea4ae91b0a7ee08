"""The job tables: what create_all builds, the partial indexes, table_args(), column types."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import Index, inspect, select, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Session

from sqla_jobs import DeadJobMixin, JobMixin
from tests import app
from tests.conftest import Database
from tests.helpers import enqueue, run_burst


def index_where(db: Database, table: str, name: str, schema: str | None = None) -> str:
    """The WHERE clause of a partial index, as the database itself reports it.

    MariaDB/MySQL have no partial indexes: there the index leads with ``state``
    instead, and this gives the condition that makes it read one state's range.
    """
    with db.engine.connect() as conn:
        if db.backend == "mariadb":
            columns = list(conn.scalars(
                text("SELECT column_name FROM information_schema.statistics WHERE table_schema = DATABASE() "
                     "AND table_name = :t AND index_name = :n ORDER BY seq_in_index"), {"t": table, "n": name}))
            assert columns, f"index {name} missing"
            state = {"pending": "'pending'", "running": "'running'"}[name.rsplit("_", 1)[1]]
            return f"state = {state}" if columns[0] == "state" else ""
        if db.backend == "postgresql":
            definition = conn.scalar(
                text("SELECT indexdef FROM pg_indexes WHERE indexname = :n AND tablename = :t "
                     "AND schemaname = COALESCE(:s, current_schema())"),
                {"n": name, "t": table, "s": schema},
            )
        else:
            definition = conn.scalar(text("SELECT sql FROM sqlite_master WHERE type = 'index' AND name = :n"),
                                     {"n": name})
    assert definition is not None, f"index {name} missing"
    where = str(definition).split("WHERE", 1)[1] if "WHERE" in str(definition) else ""
    # PostgreSQL prints ((state)::text = 'pending'::text): compare without casts and parentheses.
    return " ".join(where.replace("::text", "").replace("(", "").replace(")", "").split())


def test_create_all_makes_working_tables(db: Database) -> None:
    job_id = enqueue(db.engine, "noop")
    run_burst(db.engine)
    with Session(db.engine) as session:
        row = session.get(app.Job, job_id)
        assert row is not None
        assert (row.state, row.attempts) == ("finished", 1)
        assert row.finished_at is not None and row.created_at is not None and row.run_at is not None


def test_partial_indexes_named_after_the_table(db: Database) -> None:
    names = {ix["name"] for ix in inspect(db.engine).get_indexes("jobs")}
    assert {"ix_jobs_pending", "ix_jobs_running", "ix_jobs_finished"} <= names
    assert "state = 'pending'" in index_where(db, "jobs", "ix_jobs_pending")
    assert "state = 'running'" in index_where(db, "jobs", "ix_jobs_running")
    if db.backend != "mariadb":  # no partial indexes there: its `state`-led ones find the cancelled and blocked jobs
        assert "state = 'cancelled'" in index_where(db, "jobs", "ix_jobs_cancelled")
        assert "state = 'blocked'" in index_where(db, "jobs", "ix_jobs_blocked")
        # The dashboard's lists by queue and by kind leave out the running jobs (a claim adds no entry).
        assert "state <> 'running'" in index_where(db, "jobs", "ix_jobs_by_queue_kind")
    else:
        assert not {"ix_jobs_cancelled", "ix_jobs_blocked"} & names
    assert "ix_dead_jobs_kind" in {ix["name"] for ix in inspect(db.engine).get_indexes("dead_jobs")}


def test_no_foreign_key_between_the_tables(db: Database) -> None:
    inspector = inspect(db.engine)
    assert inspector.get_foreign_keys("jobs") == []
    assert inspector.get_foreign_keys("dead_jobs") == []


def test_payload_is_jsonb_on_postgres_and_json_on_sqlite(db: Database) -> None:
    columns = {c["name"]: c["type"] for c in inspect(db.engine).get_columns("jobs")}
    compiled = columns["payload"].compile(dialect=db.engine.dialect).upper()
    if db.backend == "postgresql":
        assert isinstance(columns["payload"], JSONB)
    elif db.backend == "mariadb":
        assert compiled == "LONGTEXT"  # the text as sent: no reordering, no 32-level JSON_VALID check
    else:
        assert compiled == "JSON"
    # Whatever the storage, the payload comes back as the dict that went in.
    job_id = enqueue(db.engine, "noop", {"a": [1, 2.5, None, True], "b": {"c": "é"}})
    with Session(db.engine) as session:
        assert session.get(app.Job, job_id).payload == {"a": [1, 2.5, None, True], "b": {"c": "é"}}  # type: ignore[union-attr]


def test_table_args_keeps_queue_indexes_and_adds_the_users(db: Database) -> None:
    suffix = uuid.uuid4().hex[:8]
    schema = f"work_{suffix}" if db.backend == "postgresql" else None

    class Base(DeclarativeBase):
        pass

    class MyJob(JobMixin, Base):
        __tablename__ = f"my_jobs_{suffix}"
        __table_args__ = JobMixin.table_args(Index(f"ix_my_jobs_{suffix}_kind", "kind"), schema=schema)

    class MyDead(DeadJobMixin, Base):
        __tablename__ = f"my_dead_{suffix}"
        __table_args__ = DeadJobMixin.table_args(Index(f"ix_my_dead_{suffix}_queue", "queue"), schema=schema)

    table = MyJob.__table__  # type: ignore[attr-defined]
    assert table.schema == schema
    assert {ix.name for ix in table.indexes} == {
        f"ix_my_jobs_{suffix}_pending", f"ix_my_jobs_{suffix}_running", f"ix_my_jobs_{suffix}_finished",
        f"ix_my_jobs_{suffix}_unique_key", f"ux_my_jobs_{suffix}_unique", f"ix_my_jobs_{suffix}_kind",
        f"ix_my_jobs_{suffix}_cancelled", f"ix_my_jobs_{suffix}_blocked",  # created only where they can be partial
        f"ix_my_jobs_{suffix}_sequence",
        f"ix_my_jobs_{suffix}_fair",  # fair queues' claim (sqla_jobs._fair)
        f"ix_my_jobs_{suffix}_by_queue_kind",  # the dashboard's lists
    }
    assert {ix.name for ix in MyDead.__table__.indexes} == {  # type: ignore[attr-defined]
        f"ix_my_dead_{suffix}_kind", f"ix_my_dead_{suffix}_queue",
    }
    try:
        if schema:
            with db.engine.begin() as conn:
                conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        Base.metadata.create_all(db.engine)
        reflected = {ix["name"] for ix in inspect(db.engine).get_indexes(table.name, schema=schema)}
        assert {f"ix_my_jobs_{suffix}_pending", f"ix_my_jobs_{suffix}_kind"} <= reflected
        assert "state = 'pending'" in index_where(db, table.name, f"ix_my_jobs_{suffix}_pending", schema)
        with Session(db.engine) as session, session.begin():
            session.add(MyJob(kind="anything", payload={"x": 1}))
        with Session(db.engine) as session:
            assert session.scalars(select(MyJob.kind)).all() == ["anything"]
    finally:
        if schema:
            with db.engine.begin() as conn:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        else:
            Base.metadata.drop_all(db.engine)


def test_state_defaults(db: Database) -> None:
    job_id = enqueue(db.engine, "noop")
    with Session(db.engine) as session:
        row: Any = session.get(app.Job, job_id)
        assert (row.state, row.queue, row.priority, row.attempts, row.max_attempts) == ("pending", "default", 0, 0, 5)
        assert row.locked_at is None and row.finished_at is None and row.last_error is None


def test_seed_columns_keep_their_names(db: Database) -> None:
    seed = {"id", "kind", "payload", "run_at", "attempts", "max_attempts", "locked_at", "finished_at", "last_error"}
    assert seed <= {c["name"] for c in inspect(db.engine).get_columns("jobs")}
