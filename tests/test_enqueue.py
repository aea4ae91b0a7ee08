"""Transactional enqueue: commit means it runs, rollback means it never existed, bad input never lands."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar

import pytest
from sqlalchemy import select
from sqlalchemy.orm import DeclarativeBase, Session

from sqla_jobs import MAX_PAYLOAD_BYTES, DeadJobMixin, InvalidJob, JobMixin, JobQueue
from tests import app
from tests.conftest import Database
from tests.helpers import count, effects, run_burst


def test_committed_job_runs(db: Database) -> None:
    with Session(db.engine) as session, session.begin():
        session.add(app.Once(job_id=-1))  # the business row
        job = app.Job(kind="record", payload={})
        session.add(job)
        session.flush()
        job_id = job.id
    run_burst(db.engine)
    assert [e[2] for e in effects(db.engine, job_id)] == ["start", "finish"]


def test_rolled_back_job_never_exists_and_never_runs(db: Database) -> None:
    with pytest.raises(RuntimeError), Session(db.engine) as session, session.begin():
        session.add(app.Once(job_id=-1))
        session.add(app.Job(kind="record", payload={}))
        session.flush()  # the INSERT was sent: only the rollback undoes it
        raise RuntimeError("the request failed")
    assert count(db.engine, app.Job) == 0
    assert count(db.engine, app.Once) == 0
    run_burst(db.engine)
    assert effects(db.engine) == []


def test_job_id_is_known_after_flush(db: Database) -> None:
    with Session(db.engine) as session, session.begin():
        job = app.Job(kind="noop", payload={})
        session.add(job)
        assert job.id is None
        session.flush()
        assert isinstance(job.id, int)
        job_id = job.id
    assert count(db.engine, app.Job, app.Job.id == job_id) == 1


def test_enqueue_helper_is_session_add(db: Database) -> None:
    with Session(db.engine) as session, session.begin():
        job = app.queue.enqueue(session, "noop", {"n": 1}, priority=3)
        session.flush()
        assert job in session and job.id is not None
    run_burst(db.engine)
    assert count(db.engine, app.Job, app.Job.state == "finished") == 1


def test_bulk_add_all(db: Database) -> None:
    with Session(db.engine) as session, session.begin():
        session.add_all([app.Job(kind="noop", payload={"n": i}) for i in range(5000)])
    assert count(db.engine, app.Job, app.Job.state == "pending") == 5000
    with Session(db.engine) as session:
        assert sorted(session.scalars(select(app.Job.payload["n"].as_integer()))) == list(range(5000))


def test_priority_queue_and_run_at_are_stored(db: Database) -> None:
    later = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=2)))
    with Session(db.engine) as session, session.begin():
        job = app.Job(kind="noop", payload={}, priority=7, queue="mail", run_at=later)
        session.add(job)
        session.flush()
        job_id = job.id
    with Session(db.engine) as session:
        row: Any = session.get(app.Job, job_id)
        assert (row.priority, row.queue) == (7, "mail")
        stored = row.run_at if row.run_at.tzinfo else row.run_at.replace(tzinfo=timezone.utc)
        assert stored == later


# -- bad input ---------------------------------------------------------------------------------

def nested(value: Any) -> dict[str, Any]:
    return {"order": {"lines": [1, {"deep": value}]}}


def circular() -> dict[str, Any]:
    payload: dict[str, Any] = {}
    payload["self"] = payload
    return payload


BAD: dict[str, tuple[Callable[[], Any], str]] = {
    "empty kind": (lambda: app.Job(kind="", payload={}), "Job.kind"),
    "whitespace kind": (lambda: app.Job(kind="   ", payload={}), "Job.kind"),
    "non-string kind": (lambda: app.Job(kind=42, payload={}), "Job.kind"),
    "missing kind": (lambda: app.Job(payload={}), "Job.kind"),
    "list payload": (lambda: app.Job(kind="noop", payload=[1, 2]), "Job.payload"),
    "string payload": (lambda: app.Job(kind="noop", payload="{}"), "Job.payload"),
    "datetime in payload": (lambda: app.Job(kind="noop", payload={"when": datetime.now()}),
                            "Job.payload['when'] is a datetime, which JSON cannot store"),
    "set in payload": (lambda: app.Job(kind="noop", payload=nested({1, 2})),
                       "Job.payload['order']['lines'][1]['deep'] is a set"),
    "circular payload": (lambda: app.Job(kind="noop", payload=circular()), "circular reference"),
    "tuple key": (lambda: app.Job(kind="noop", payload={(1, 2): "x"}), "key (1, 2) of type tuple"),
    "NaN": (lambda: app.Job(kind="noop", payload={"x": math.nan}), "Job.payload['x'] is nan; JSON has no NaN"),
    "+inf": (lambda: app.Job(kind="noop", payload={"x": math.inf}), "Job.payload['x'] is inf"),
    "-inf": (lambda: app.Job(kind="noop", payload=nested(-math.inf)),
             "Job.payload['order']['lines'][1]['deep'] is -inf"),
    "NUL in value": (lambda: app.Job(kind="noop", payload={"x": "a\u0000b"}), "\\u0000"),
    "NUL in nested value": (lambda: app.Job(kind="noop", payload=nested("\u0000")), "\\u0000"),
    "NUL in key": (lambda: app.Job(kind="noop", payload={"a\u0000": 1}), "\\u0000"),
    "NUL in nested key": (lambda: app.Job(kind="noop", payload=nested({"k\u0000": 1})), "\\u0000"),
    "lone surrogate in value": (lambda: app.Job(kind="noop", payload=nested("caf\udce9")), "lone surrogate"),
    "lone surrogate in key": (lambda: app.Job(kind="noop", payload={"\ud800": 1}), "lone surrogate"),
    "lone surrogate in kind": (lambda: app.Job(kind="send\udce9", payload={}), "Job.kind is not valid Unicode"),
    "NUL in kind": (lambda: app.Job(kind="send\u0000", payload={}), "Job.kind"),
    "int key": (lambda: app.Job(kind="noop", payload={1: "x"}), "non-string key"),
    "nested int key": (lambda: app.Job(kind="noop", payload=nested({2: "x"})), "non-string key"),
    "too big": (lambda: app.Job(kind="noop", payload={"x": "a" * MAX_PAYLOAD_BYTES}), "byte limit"),
    "max_attempts 0": (lambda: app.Job(kind="noop", payload={}, max_attempts=0), "Job.max_attempts"),
    "max_attempts negative": (lambda: app.Job(kind="noop", payload={}, max_attempts=-3), "Job.max_attempts"),
    "max_attempts bool": (lambda: app.Job(kind="noop", payload={}, max_attempts=True), "Job.max_attempts"),
    "max_attempts str": (lambda: app.Job(kind="noop", payload={}, max_attempts="5"), "Job.max_attempts"),
    "priority too big": (lambda: app.Job(kind="noop", payload={}, priority=2**31), "Job.priority must fit in 32 bits"),
    "max_attempts too big": (lambda: app.Job(kind="noop", payload={}, max_attempts=2**40), "Job.max_attempts"),
    "priority float": (lambda: app.Job(kind="noop", payload={}, priority=1.5), "Job.priority"),
    "empty queue": (lambda: app.Job(kind="noop", payload={}, queue=""), "Job.queue"),
    "run_at string": (lambda: app.Job(kind="noop", payload={}, run_at="tomorrow"), "Job.run_at"),
    "unknown kind": (lambda: app.Job(kind="sned_email", payload={}), "known kinds: async_hang, async_noop, "),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_fails_before_commit_and_takes_the_business_rows_with_it(db: Database, case: str) -> None:
    make, expected = BAD[case]
    with pytest.raises(InvalidJob) as raised, Session(db.engine) as session, session.begin():
        session.add(app.Once(job_id=-1))  # the business row of the same transaction
        session.add(make())
    assert expected in str(raised.value)
    assert count(db.engine, app.Once) == 0
    assert count(db.engine, app.Job) == 0


def test_payload_changed_after_construction_is_checked_again_at_flush(db: Database) -> None:
    payload: dict[str, Any] = {"ok": 1}
    with pytest.raises(InvalidJob, match=r"Job\.payload"), Session(db.engine) as session, session.begin():
        session.add(app.Once(job_id=-1))
        session.add(app.Job(kind="noop", payload=payload))
        payload["bad"] = math.nan  # mutated in place: no attribute set, only the flush can see it
    assert count(db.engine, app.Once) == 0
    assert count(db.engine, app.Job) == 0


def test_payload_at_the_limit_is_accepted(db: Database) -> None:
    filler = MAX_PAYLOAD_BYTES - len('{"x":""}')
    with Session(db.engine) as session, session.begin():
        session.add(app.Job(kind="noop", payload={"x": "a" * filler}))
    assert count(db.engine, app.Job) == 1


class OtherBase(DeclarativeBase):
    pass


class SmallJob(JobMixin, OtherBase):
    __tablename__ = "small_jobs"
    max_payload_bytes: ClassVar[int] = 100


class SmallDead(DeadJobMixin, OtherBase):
    __tablename__ = "small_dead_jobs"


#: A queue with handlers that does not check kinds: for apps whose web process does not import handlers.
lenient: JobQueue[SmallJob, SmallDead] = JobQueue(SmallJob, SmallDead, check_kinds=False)


@lenient.handler("known")
def known(payload: dict[str, Any]) -> None:
    pass


def test_per_model_payload_limit(db: Database) -> None:
    OtherBase.metadata.create_all(db.engine)
    with pytest.raises(InvalidJob, match="over the 100-byte limit"):
        SmallJob(kind="known", payload={"x": "a" * 100})
    with Session(db.engine) as session, session.begin():
        session.add(SmallJob(kind="known", payload={"x": "a" * 50}))
    assert count(db.engine, SmallJob) == 1


def test_check_kinds_false_accepts_unknown_kinds(db: Database) -> None:
    OtherBase.metadata.create_all(db.engine)
    with Session(db.engine) as session, session.begin():
        session.add(SmallJob(kind="not_registered", payload={}))
    assert count(db.engine, SmallJob, SmallJob.kind == "not_registered") == 1


class RuledBase(DeclarativeBase):
    pass


class RuledJob(JobMixin, RuledBase):
    __tablename__ = "ruled_jobs"


class RuledDead(DeadJobMixin, RuledBase):
    __tablename__ = "ruled_dead_jobs"


class TenantRule(JobQueue[RuledJob, RuledDead]):
    """An app with a rule of its own, through the public enqueue-time hook."""

    seen: ClassVar[list[tuple[str, str | None, dict[str, Any]]]] = []

    def check_job(self, job: Any) -> None:
        super().check_job(job)
        TenantRule.seen.append((job.kind, job.queue, job.payload))
        if "tenant" not in job.payload:
            raise InvalidJob(f"Job.payload: a {job.kind!r} job needs a tenant")


ruled = TenantRule(RuledJob, RuledDead)


@ruled.handler("bill")
def bill(payload: dict[str, Any]) -> None:
    pass


def test_check_job_is_the_enqueue_time_hook_on_every_path(db: Database) -> None:
    RuledBase.metadata.create_all(db.engine)
    TenantRule.seen.clear()
    # session.add: refused at flush, with the caller's business rows.
    with pytest.raises(InvalidJob, match="needs a tenant"), Session(db.engine) as session, session.begin():
        session.add(RuledJob(kind="bill", payload={"amount": 3}))
    # enqueue_many: the same rule, one bad item refuses the whole call.
    with pytest.raises(InvalidJob, match="needs a tenant"), Session(db.engine) as session, session.begin():
        ruled.enqueue_many(session, [{"kind": "bill", "payload": {"tenant": 1}}, {"kind": "bill", "queue": "eu"}])
    assert count(db.engine, RuledJob) == 0
    # The default check still runs first (super()): an unknown kind is refused before the rule sees it.
    with pytest.raises(InvalidJob, match="known kinds: bill"), Session(db.engine) as session, session.begin():
        session.add(RuledJob(kind="bil", payload={"tenant": 1}))
    with Session(db.engine) as session, session.begin():
        session.add(RuledJob(kind="bill", queue="eu", payload={"tenant": 1}))
        assert ruled.enqueue_many(session, [{"kind": "bill", "payload": {"tenant": 2}}]) == 1
    assert count(db.engine, RuledJob) == 2
    # The hook saw the decoded payload on both paths, and the queue as given (the view fills the default).
    assert TenantRule.seen == [
        ("bill", None, {"amount": 3}),
        ("bill", "default", {"tenant": 1}),
        ("bill", "eu", {}),
        ("bill", "default", {"tenant": 2}),  # enqueue_many checks at the call; it flushes the session after
        ("bill", "eu", {"tenant": 1}),
    ]


def test_the_model_class_is_not_written_on() -> None:
    # The apps of a model are found through sqla_jobs' own bookkeeping, not an attribute set on the user's class.
    assert not [name for name in vars(RuledJob) if "sqla_jobs" in name]
    assert not [name for name in vars(app.Job) if "sqla_jobs" in name]
