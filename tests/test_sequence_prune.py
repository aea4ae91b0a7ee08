"""Pruning sequences' rows (``<jobs>_sequences``, one per key ever used): ``queue.prune`` deletes the rows of
keys whose last job has ended, keeps those a job still waits behind (a live or dead last job), and an enqueuer
racing the pruner for a key never loses its place in the chain. On every backend and layout."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.orm import Session

from tests import app
from tests.conftest import Database
from tests.helpers import run_burst
from tests.test_sequences import LAYOUTS, sdb, seq_job, states

__all__ = ["sdb"]  # the fixture, used by the tests below


def _keys(sdb: Database) -> dict[str, Any]:
    s = app.queue.driver(sdb.engine).sequences
    with sdb.engine.connect() as conn:
        return dict(conn.execute(select(s.c.key, s.c.last_id)).all())


def test_prune_deletes_the_rows_of_ended_sequences_and_keeps_the_rest(sdb: Database, tmp_path: Path) -> None:
    log, flag = tmp_path / "runs.log", tmp_path / "fail"
    flag.touch()
    with Session(sdb.engine, expire_on_commit=False) as session, session.begin():
        session.add_all([seq_job(log, "ended", 0), seq_job(log, "ended", 1),
                         seq_job(log, "dead", 0, payload={"fail_while": str(flag)}, max_attempts=1)])
    run_burst(sdb.engine, concurrency=2)
    with Session(sdb.engine, expire_on_commit=False) as session, session.begin():
        waiting = seq_job(log, "waiting", 0)
        session.add(waiting)
    assert set(_keys(sdb)) == {"ended", "dead", "waiting"}

    app.queue.prune(sdb.engine, older_than=0)
    assert set(_keys(sdb)) == {"dead", "waiting"}  # the dead job holds its key; the pending one is its tail

    # A key pruned away starts afresh: its next job waits for nothing, the one after waits for that one.
    with Session(sdb.engine, expire_on_commit=False) as session, session.begin():
        first, second = seq_job(log, "ended", 2), seq_job(log, "ended", 3)
        session.add(first)
        session.flush()
        session.add(second)
    assert states(sdb.engine, first, second) == ["pending", "blocked"]
    assert _keys(sdb)["ended"] == second.id


@pytest.mark.parametrize("sdb", [layout for layout in LAYOUTS if layout != "sqlite"], indirect=True)
def test_an_enqueuer_whose_key_is_pruned_under_it_keeps_its_place(sdb: Database, tmp_path: Path) -> None:
    """The enqueuer has made sure its key's row exists (PostgreSQL's insert-or-nothing, which takes no lock) and
    is about to lock it when the pruner deletes it and commits. The enqueuer makes it again and is the key's
    last job, so the next job of the key waits for it. (SQLite has one writer at a time: no such race.)"""
    log = tmp_path / "runs.log"
    with Session(sdb.engine) as session, session.begin():
        session.add(seq_job(log, "k", 0))
    run_burst(sdb.engine)
    sequences = app.queue.driver(sdb.engine).sequences.name
    at_the_lock, pruned = threading.Event(), threading.Event()
    enqueuer: list[threading.Thread] = []

    def pause_before_the_lock(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if threading.current_thread() in enqueuer and "FOR UPDATE" in statement and sequences in statement:
            at_the_lock.set()
            assert pruned.wait(30)

    made: list[app.Job] = []

    def enqueue() -> None:
        with Session(sdb.engine, expire_on_commit=False) as session, session.begin():
            made.append(seq_job(log, "k", 1))
            session.add(made[0])

    event.listen(sdb.engine, "before_cursor_execute", pause_before_the_lock)
    try:
        enqueuer.append(threading.Thread(target=enqueue))
        enqueuer[0].start()
        assert at_the_lock.wait(30)
        app.queue.prune(sdb.engine, older_than=0)  # MariaDB: the enqueuer's upsert locked the row; it is skipped
        pruned.set()
        enqueuer[0].join(30)
    finally:
        pruned.set()
        event.remove(sdb.engine, "before_cursor_execute", pause_before_the_lock)
    assert made and made[0].id is not None
    assert _keys(sdb)["k"] == made[0].id
    with Session(sdb.engine, expire_on_commit=False) as session, session.begin():
        after = seq_job(log, "k", 2)
        session.add(after)
    assert states(sdb.engine, made[0], after) == ["pending", "blocked"]
