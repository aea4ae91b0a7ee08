"""``queue.emit_events``: many events in one call, in the caller's transaction (docs/howto/durable.md, "Emit many
events"): what ``emit_event`` of each in turn would do, in a few statements whatever their number."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sqla_jobs import InvalidJob
from tests import durable_app
from tests.conftest import Database
from tests.helpers import enqueue, job, run_burst, utc
from tests.test_asyncio import async_url
from tests.test_durable import emit, steps

queue = durable_app.queue


def _parked(db: Database, keys: list[str]) -> list[int]:
    ids = [enqueue(db.engine, "d_wait", {"key": key}) for key in keys]
    run_burst(db.engine)
    assert all(job(db.engine, i).state == "pending" for i in ids)  # type: ignore[union-attr]
    return ids


def test_emit_events_wakes_each_waiter_with_its_data_and_the_first_emit_of_a_key_wins(db: Database) -> None:
    ids = _parked(db, ["m:0", "m:0", "m:1", "m:2", "m:3", "m:4"])
    assert emit(db, "m:4", "earlier") == 1  # an emit before the call wins over the call's
    with Session(db.engine) as session, session.begin():
        # m:0 given twice: its first data wins, as two emit_event calls in a row would have it.
        events = [("m:0", 0), ("m:1", 1), ("m:0", "second"), ("m:2", {"x": 2}), ("m:4", "late"),
                  ("m:9", {"é": ["ü", None, 1.5, True, "x" * 300]})]
        assert queue.emit_events(session, events) == 4  # the two jobs on m:0, m:1's, m:2's
    with Session(db.engine) as session:
        assert queue.waiting_for(session, "m:3") == [ids[4]]
        assert [queue.get_event(session, k).data for k in ("m:0", "m:4", "m:9")] == [  # type: ignore[union-attr]
            0, "earlier", {"é": ["ü", None, 1.5, True, "x" * 300]}]
    assert steps(db, ids[3])["event:m:2"].value == {"x": 2}  # the wait ended with its own event's data
    run_burst(db.engine)
    results = [job(db.engine, i).result for i in ids]  # type: ignore[union-attr]
    assert results == [{"data": 0}, {"data": 0}, {"data": 1}, {"data": {"x": 2}}, None, {"data": "earlier"}]
    with Session(db.engine) as session, session.begin():  # a mapping too; all emitted before: nothing woken
        assert queue.emit_events(session, {"m:0": "again", "m:1": "again"}) == 0
        assert queue.emit_events(session, {}) == 0


def test_emit_events_takes_the_same_few_statements_for_3_events_as_for_300(db: Database) -> None:
    _parked(db, ["few:0", "many:0"])
    counts = []

    def count(*args: Any) -> None:
        counts[-1] += 1

    event.listen(db.engine, "before_cursor_execute", count)
    try:
        for prefix, n in (("few", 3), ("many", 300)):
            with Session(db.engine) as session, session.begin():
                session.connection()  # the connection's own statements (BEGIN on some backends) before the count
                counts.append(0)
                assert queue.emit_events(session, {f"{prefix}:{i}": i for i in range(n)}) == 1
    finally:
        event.remove(db.engine, "before_cursor_execute", count)
    assert counts[0] == counts[1] <= 6, counts  # emit_event 300 times: 900 to 1,200


def test_a_rolled_back_emit_events_leaves_no_event_and_wakes_nothing(db: Database) -> None:
    [job_id] = _parked(db, ["rb:1"])
    due = job(db.engine, job_id).run_at  # type: ignore[union-attr]
    with Session(db.engine) as session:
        assert queue.emit_events(session, {"rb:1": 1, "rb:2": 2}) == 1
        session.rollback()
    assert utc(job(db.engine, job_id).run_at) == utc(due)  # type: ignore[union-attr]
    assert steps(db, job_id)["event:rb:1"].finished_at is None
    with Session(db.engine) as session:
        assert queue.get_event(session, "rb:1") is None and queue.get_event(session, "rb:2") is None
        assert queue.waiting_for(session, "rb:1") == [job_id]


def test_emit_events_refuses_what_emit_event_refuses_and_writes_nothing_then(db: Database) -> None:
    def refusal(call: Any) -> str:
        with Session(db.engine) as session, session.begin():
            with pytest.raises(InvalidJob) as caught:
                call(session)
            assert queue.get_event(session, "ok") is None  # the good event before the bad one was not written
        return str(caught.value)

    for bad_key, bad_data in (("", 1), (7, 1), ("k", object()), ("k", {"n": float("nan")})):
        alone = refusal(lambda s: queue.emit_event(s, bad_key, bad_data))  # noqa: B023 - called at once
        assert refusal(lambda s: queue.emit_events(s, [("ok", 1), (bad_key, bad_data)])) == alone  # noqa: B023
    with Session(db.engine) as session, pytest.raises(TypeError, match=r"\(key, data\) pairs"):
        queue.emit_events(session, ["ok"])  # type: ignore[list-item]


def test_the_async_session_twin_emits_many_in_the_callers_transaction(db: Database) -> None:
    [job_id] = _parked(db, ["as:1"])

    async def scenario() -> int:
        engine = create_async_engine(async_url(db))
        try:
            async with engine.begin() as conn, AsyncSession(bind=conn) as session:
                return await queue.aio.emit_events(session, {"as:1": "one", "as:2": 2})
        finally:
            await engine.dispose()

    assert asyncio.run(scenario()) == 1
    run_burst(db.engine)
    assert job(db.engine, job_id).result == {"data": "one"}  # type: ignore[union-attr]
