"""``Job(...)``: the constructor checks and stores fields without attribute events, and gives way to the app's own."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar

import pytest
from sqlalchemy import event, inspect, select
from sqlalchemy.orm import DeclarativeBase, Session, validates

from sqla_jobs import DeadJobMixin, InvalidJob, JobMixin
from tests import app
from tests.conftest import Database


class OwnBase(DeclarativeBase):
    pass


class TaggedJob(JobMixin, OwnBase):
    """An app's model with a validator of its own and a set listener on one of sqla-jobs' fields."""

    __tablename__ = "tagged_jobs"
    seen_queues: ClassVar[list[str]] = []

    @validates("locked_by")
    def _check_locked_by(self, key: str, value: Any) -> Any:
        return value.upper()


class TaggedDead(DeadJobMixin, OwnBase):
    __tablename__ = "tagged_dead_jobs"


@event.listens_for(TaggedJob.queue, "set", retval=True)
def _record_queue(target: Any, value: Any, old: Any, initiator: Any) -> Any:
    TaggedJob.seen_queues.append(value)
    return value


def test_the_fields_given_are_the_row_written(db: Database) -> None:
    naive = datetime(2030, 1, 2, 3, 4, 5, 678901)
    job = app.Job(kind="noop", payload={"a": [1, "é"]}, queue="mail", priority=7, max_attempts=2, run_at=naive,
                  unique_key="k-1")
    assert (job.kind, job.queue, job.priority, job.max_attempts) == ("noop", "mail", 7, 2)
    assert job.run_at == naive.replace(tzinfo=timezone.utc)  # the validator's value is what is stored
    with Session(db.engine) as session, session.begin():
        session.add(job)
        session.flush()
        job_id = job.id
        assert not inspect(job).pending
    with Session(db.engine) as session:
        row = session.execute(select(app.Job.kind, app.Job.payload, app.Job.queue, app.Job.priority,
                                     app.Job.max_attempts, app.Job.run_at, app.Job.unique_key,
                                     app.Job.unique_states).where(app.Job.id == job_id)).one()
    assert row[:5] == ("noop", {"a": [1, "é"]}, "mail", 7, 2)
    assert abs(row.run_at.replace(tzinfo=timezone.utc) - naive.replace(tzinfo=timezone.utc)) < timedelta(seconds=1)
    assert (row.unique_key, row.unique_states) == ("k-1", ("pending", "running"))


def test_a_field_changed_after_construction_is_checked_and_written(db: Database) -> None:
    job = app.Job(kind="noop", payload={})
    with pytest.raises(InvalidJob, match=r"Job\.kind"):
        job.kind = ""
    with pytest.raises(InvalidJob, match=r"Job\.priority"):
        job.priority = 2**40
    job.priority = 3
    job.payload = {"changed": True}
    with Session(db.engine) as session, session.begin():
        session.add(job)
    with Session(db.engine) as session:
        assert session.execute(select(app.Job.priority, app.Job.payload)).one() == (3, {"changed": True})


def test_an_unknown_keyword_is_a_type_error_as_with_sqlalchemys_constructor() -> None:
    with pytest.raises(TypeError, match="'knd' is an invalid keyword argument for Job"):
        app.Job(knd="noop", payload={})


def test_the_apps_own_validator_and_listener_still_run(db: Database) -> None:
    OwnBase.metadata.create_all(db.engine)
    try:
        TaggedJob.seen_queues.clear()
        job = TaggedJob(kind="noop", payload={}, queue="q1", locked_by="host:1")
        assert (job.queue, job.locked_by) == ("q1", "HOST:1")
        assert TaggedJob.seen_queues == ["q1"]
        with pytest.raises(InvalidJob, match=r"Job\.queue"):  # sqla-jobs' validator runs beside the listener
            TaggedJob(kind="noop", payload={}, queue="")
        with pytest.raises(InvalidJob, match=r"Job\.kind"):
            TaggedJob(kind=" ", payload={})
        with Session(db.engine) as session, session.begin():
            session.add(job)
        with Session(db.engine) as session:
            assert session.execute(select(TaggedJob.queue, TaggedJob.locked_by)).one() == ("q1", "HOST:1")
    finally:
        OwnBase.metadata.drop_all(db.engine)


def test_a_listener_added_after_the_first_job_is_heard() -> None:
    app.Job(kind="noop", payload={}, priority=1)  # the model's fields are looked up by now
    heard: list[Any] = []

    def listen(target: Any, value: Any, old: Any, initiator: Any) -> None:
        heard.append(value)

    event.listen(app.Job.priority, "set", listen)
    try:
        app.Job(kind="noop", payload={}, priority=4)
    finally:
        event.remove(app.Job.priority, "set", listen)
    assert heard == [4]
