"""Typed payloads (sqla_jobs._typed): a handler declares a dataclass, TypedDict or pydantic model;
the payload is checked at enqueue and handed to the handler as that type."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel
from sqlalchemy import Engine, insert, select
from sqlalchemy.orm import DeclarativeBase, Session

from sqla_jobs import DeadJobMixin, InvalidJob, JobMixin, JobQueue
from sqla_jobs.errors import ConfigError
from sqla_jobs.testing import run_due
from tests import forkserver
from tests.conftest import Database


class Base(DeclarativeBase):
    pass


class TypedJob(JobMixin, Base):
    __tablename__ = "typed_jobs"


class TypedDeadJob(DeadJobMixin, Base):
    __tablename__ = "typed_dead_jobs"


@dataclass
class Welcome:
    user_id: int
    language: str = "en"
    tags: list[str] = field(default_factory=list)


class Invoice(TypedDict):
    number: str
    cents: int


class Refund(BaseModel):
    order_id: int
    reason: str


queue = JobQueue(TypedJob, TypedDeadJob)
received: list[Any] = []


@queue.handler("welcome")
def welcome(payload: Welcome) -> None:
    received.append(payload)


@queue.handler("invoice")
def invoice(payload: Invoice) -> None:
    received.append(payload)


@queue.handler("refund")
async def refund(payload: Refund) -> None:
    await asyncio.sleep(0)
    received.append(payload)


@queue.handler("untyped")
def untyped(payload: dict[str, Any]) -> None:
    received.append(payload)


@pytest.fixture
def engine(db: Database) -> Iterator[Engine]:
    Base.metadata.create_all(db.engine)
    received.clear()
    yield db.engine
    Base.metadata.drop_all(db.engine)


def test_each_handler_gets_its_declared_type(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        session.add_all([
            TypedJob(kind="welcome", payload={"user_id": 7, "tags": ["new"]}),
            TypedJob(kind="invoice", payload={"number": "F-1", "cents": 1250}),
            TypedJob(kind="refund", payload={"order_id": 3, "reason": "late"}),
            TypedJob(kind="untyped", payload={"anything": [1, 2]}),
        ])
    report = run_due(engine, queue)
    assert sorted(e.kind for e in report.finished) == ["invoice", "refund", "untyped", "welcome"]
    by_type = {type(r).__name__: r for r in received}
    assert by_type["Welcome"] == Welcome(user_id=7, language="en", tags=["new"])
    assert by_type["Refund"] == Refund(order_id=3, reason="late")
    assert {"number": "F-1", "cents": 1250} in received  # a TypedDict is a dict at run time
    assert {"anything": [1, 2]} in received  # a dict handler is unchanged


@pytest.mark.parametrize(("kind", "payload", "problem"), [
    ("welcome", {"user_id": "seven"}, "payload['user_id']"),
    ("welcome", {"language": "fr"}, "payload['user_id']"),
    ("welcome", {"user_id": 1, "langauge": "fr"}, "payload['langauge']: not a field of Welcome"),
    ("invoice", {"number": "F-2"}, "payload['cents']"),
    ("refund", {"order_id": 1}, "payload['reason']"),
])
def test_a_payload_that_does_not_fit_is_refused_at_enqueue(
    engine: Engine, kind: str, payload: dict[str, Any], problem: str
) -> None:
    with Session(engine) as session:
        session.add(TypedJob(kind=kind, payload=payload))
        with pytest.raises(InvalidJob, match=rf"^the payload of a '{kind}' job does not fit \w+: .*") as refused:
            session.flush()
        assert problem in str(refused.value)
    with Session(engine) as session:
        with pytest.raises(InvalidJob, match=problem.replace("[", r"\[")):
            queue.enqueue_many(session, [{"kind": "welcome", "payload": {"user_id": 1}},
                                         {"kind": kind, "payload": payload}])
        session.commit()
        assert session.scalars(select(TypedJob)).all() == []  # one bad item: nothing written


def test_an_instance_of_the_type_is_stored_as_its_json_object(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        session.add(TypedJob(kind="welcome", payload=Welcome(user_id=9, tags=["vip"])))
        queue.enqueue_many(session, [{"kind": "refund", "payload": Refund(order_id=4, reason="broken")}])
    with Session(engine) as session:
        stored = {j.kind: j.payload for j in session.scalars(select(TypedJob))}
    assert stored == {"welcome": {"user_id": 9, "language": "en", "tags": ["vip"]},
                      "refund": {"order_id": 4, "reason": "broken"}}
    run_due(engine, queue)
    assert Welcome(user_id=9, tags=["vip"]) in received and Refund(order_id=4, reason="broken") in received


def test_a_stored_payload_that_no_longer_fits_fails_the_attempt_with_the_same_message(engine: Engine) -> None:
    # Written around the check (raw SQL, or before the type changed): the run refuses it, clearly.
    with engine.begin() as conn:
        conn.execute(insert(TypedJob.__table__).values(kind="welcome", payload={"user": 1}, max_attempts=1))
    [dead] = run_due(engine, queue).dead
    assert dead.error is not None and "does not fit Welcome" in dead.error and "payload['user_id']" in dead.error
    assert received == []


def test_only_dataclasses_typeddicts_and_pydantic_models_are_payload_types() -> None:
    other = JobQueue(TypedJob, TypedDeadJob)
    with pytest.raises(ConfigError, match="payload_type must be a dataclass, a TypedDict or a pydantic model"):
        other.handler("n", payload_type=int)(lambda payload: None)

    @other.handler("explicit", payload_type=Welcome)
    def explicit(payload: Any) -> None: ...

    assert other.handlers["explicit"].payload is not None
    assert other.handlers["explicit"].fn is not explicit  # the worker calls the converting wrapper
    assert explicit.__name__ == "explicit"  # and the decorator hands back the user's own function


@given(st.builds(Welcome, user_id=st.integers(-(2**63), 2**63 - 1), language=st.text(max_size=20),
                 tags=st.lists(st.text(max_size=10), max_size=5)))
def test_an_instance_survives_the_trip_through_json(instance: Welcome) -> None:
    schema = queue.handlers["welcome"].payload
    assert schema is not None
    assert schema.load(json.loads(json.dumps(asdict(instance)))) == instance


def test_without_pydantic_keys_and_simple_types_are_still_checked() -> None:
    script = textwrap.dedent("""
        import sys
        sys.modules["pydantic"] = None  # as if it were not installed
        from dataclasses import dataclass
        from typing import TypedDict
        from sqla_jobs._typed import PayloadSchema
        from sqla_jobs.errors import InvalidJob

        @dataclass
        class Welcome:
            user_id: int
            ratio: float = 1.0
            note: object = None

        class Invoice(TypedDict):
            number: str

        w, i = PayloadSchema("welcome", Welcome), PayloadSchema("invoice", Invoice)
        print(repr(w.load({"user_id": 1, "ratio": 2, "note": ["any"]})))
        print(repr(i.load({"number": "F-1"})))
        for schema, bad in ((w, {"user_id": True, "extra": 1}), (w, {}), (i, {"number": 5}), (w, [1])):
            try:
                schema.load(bad)
            except InvalidJob as exc:
                print(exc)
    """)
    out = forkserver.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.splitlines() == [
        "Welcome(user_id=1, ratio=2, note=['any'])",
        "{'number': 'F-1'}",
        "the payload of a 'welcome' job does not fit Welcome: payload['extra']: not a field of Welcome; "
        "payload['user_id']: expected int, got bool",
        "the payload of a 'welcome' job does not fit Welcome: payload['user_id']: missing",
        "the payload of a 'invoice' job does not fit Invoice: payload['number']: expected str, got int",
        "the payload of a 'welcome' job does not fit Welcome: expected a JSON object, got list",
    ]
