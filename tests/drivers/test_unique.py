"""Unique keys at the driver: the index lets one holder in, the holder is found, the key moves with the state."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from sqla_jobs._unique import insert_or_update
from tests.drivers.conftest import Backend, at_once, in_write


def _row(key: str, states: tuple[str, ...] = ("pending", "running"), **fields: Any) -> dict[str, Any]:
    return {"kind": "noop", "queue": "default", "payload": json.dumps({"k": key}), "priority": 0, "max_attempts": 5,
            "run_at": None, "unique_key": key, "unique_states": states, **fields}


def test_one_holder_per_key_and_the_transaction_goes_on(backend: Backend) -> None:
    d = backend.driver

    def twice(conn: Any) -> tuple[Any, ...]:
        first = d.insert_unique(conn, _row("k"))
        second = d.insert_unique(conn, _row("k"))  # refused, and this transaction is still usable:
        other = d.insert_unique(conn, _row("other"))
        return first, second, other, d.unique_holder(conn, "k")

    first, second, other, holder = in_write(backend, twice)
    assert isinstance(first, int) and second is None and isinstance(other, int) and holder == first
    row = backend.row(first)
    assert (row.unique_key, row.unique_states, row.unique_held, row.payload) == ("k", ("pending", "running"), "k",
                                                                                   {"k": "k"})


def test_the_key_is_held_only_in_its_states(backend: Backend) -> None:
    d = backend.driver
    plain = in_write(backend, lambda c: d.insert_unique(c, _row("a")))
    kept = in_write(backend, lambda c: d.insert_unique(c, _row("b", ("pending", "running", "finished"))))
    for job_id in (plain, kept):
        backend.set(job_id, state="running")
        assert backend.row(job_id).unique_held is not None
        backend.set(job_id, state="finished")
    assert backend.row(plain).unique_held is None and backend.row(kept).unique_held == "b"
    assert in_write(backend, lambda c: d.unique_holder(c, "a")) is None
    assert in_write(backend, lambda c: d.insert_unique(c, _row("a"))) is not None
    assert in_write(backend, lambda c: d.insert_unique(c, _row("b"))) is None


def test_a_job_without_a_key_holds_nothing(backend: Backend) -> None:
    ids = backend.insert(3)
    assert [backend.row(i).unique_held for i in ids] == [None, None, None]


def test_a_plain_insert_of_a_held_key_fails_with_an_integrity_error(backend: Backend) -> None:
    from sqlalchemy import insert

    in_write(backend, lambda c: backend.driver.insert_unique(c, _row("x")))
    t = backend.driver.jobs
    try:
        in_write(backend, lambda c: c.execute(insert(t).values(kind="noop", payload={}, unique_key="x",
                                                                unique_states=("pending", "running"))))
    except IntegrityError as exc:
        assert backend.driver.is_duplicate_key(exc)
    else:
        raise AssertionError("the unique index let a second holder in")


def test_concurrent_inserts_of_one_key_leave_one_row(backend: Backend) -> None:
    d = backend.driver
    results = at_once([lambda: in_write(backend, lambda c: d.insert_unique(c, _row("race")))] * 6)
    assert sum(r is not None for r in results) == 1 and not [r for r in results if isinstance(r, Exception)]
    with backend.db.engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM jobs WHERE unique_key = 'race'")).scalar() == 1


def test_dead_letter_keeps_the_key_for_the_record(backend: Backend) -> None:
    d = backend.driver
    job_id = in_write(backend, lambda c: d.insert_unique(c, _row("slot", max_attempts=1)))
    [job] = backend.claim(1)
    assert job.id == job_id
    assert in_write(backend, lambda c: d.dead_letter(c, job.fence, "boom"))
    assert backend.dead_row(job_id).unique_key == "slot"
    assert in_write(backend, lambda c: d.dead_has_key(c, "slot"))
    assert not in_write(backend, lambda c: d.dead_has_key(c, "other"))
    assert in_write(backend, lambda c: d.unique_holder(c, "slot")) is None  # the dead job holds nothing
    assert in_write(backend, lambda c: d.requeue_dead(c, ids=[job_id])) == [job_id]
    assert backend.row(job_id).unique_key is None  # requeued without its key: it can collide with nothing


def test_update_holder_changes_only_a_pending_holder(backend: Backend) -> None:
    d = backend.driver
    soon = datetime.now(timezone.utc) + timedelta(seconds=30)
    job_id = in_write(backend, lambda c: d.insert_unique(c, _row("k", run_at=soon)))
    # replace: the payload only
    assert in_write(backend, lambda c: d.update_holder(c, "k", json.dumps({"n": 2}), None)) is True
    row = backend.row(job_id)
    assert row.payload == {"n": 2} and abs((row.run_at.replace(tzinfo=timezone.utc) - soon).total_seconds()) < 0.01
    # debounce: pushed out to a later run_at, never pulled in by an earlier one
    later = soon + timedelta(seconds=60)
    assert in_write(backend, lambda c: d.update_holder(c, "k", json.dumps({"n": 3}), later)) is True
    assert in_write(backend, lambda c: d.update_holder(c, "k", json.dumps({"n": 4}), soon)) is True
    row = backend.row(job_id)
    assert row.payload == {"n": 4} and abs((row.run_at.replace(tzinfo=timezone.utc) - later).total_seconds()) < 0.01
    # a running holder is left alone, and so is a key nobody holds
    backend.set(job_id, state="running")
    assert in_write(backend, lambda c: d.update_holder(c, "k", json.dumps({"n": 5}), None)) is False
    assert backend.row(job_id).payload == {"n": 4}
    assert in_write(backend, lambda c: d.update_holder(c, "nobody", json.dumps({}), None)) is False


def test_concurrent_debounces_of_a_held_key_never_deadlock(backend: Backend) -> None:
    """8 transactions debounce one committed pending holder at once, 10 rounds: none fails (on InnoDB each
    duplicate INSERT leaves a shared lock on the holder's entry before the update asks for the exclusive one;
    they must queue, not deadlock), the holder ends with a payload one of them gave and the latest run_at.
    docs/howto/unique-jobs.md also warns of a holder whose own transaction is still open: not reproduced here."""
    d = backend.driver
    soon = datetime.now(timezone.utc) + timedelta(seconds=60)
    holder = in_write(backend, lambda c: d.insert_unique(c, _row("hot", run_at=soon)))
    for round_ in range(10):
        rows = [_row("hot", run_at=soon + timedelta(seconds=round_ * 10 + n), payload=json.dumps({"n": n}))
                for n in range(8)]
        debounces = [lambda row=row: in_write(backend, lambda c: insert_or_update(d, c, row, "debounce"))
                     for row in rows]
        assert at_once(debounces) == [(None, True)] * 8
        row = backend.row(holder)
        assert row.payload["n"] in range(8)
        assert abs((row.run_at.replace(tzinfo=timezone.utc) - rows[-1]["run_at"]).total_seconds()) < 0.01
