"""PostgreSQL: the claim reads the claimed payloads through ``drivers/postgresql/payloads.py``.

Its loader skips ``json.loads``' encoding sniff and whitespace scans, which PostgreSQL's ``jsonb``
text never needs; the payloads a handler gets must be what ``json.loads`` would have made, and an
engine's own ``json_deserializer`` still reads them.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg.types.json
import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from sqla_jobs.worker.store import Store

from . import app
from .conftest import Database

PAYLOADS: list[dict[str, Any]] = [
    {},
    {"n": 1, "big": 9007199254740993, "float": 2.5, "neg": -0.0, "tiny": 1e-300},
    {"text": "é \n \" \\ \u2603 \U0001f600", "nested": {"list": [1, [2, [3]], None, True, False], "empty": {}}},
    {"spaces in key": " padded ", "": ""},
]


def _claim_all(engine: Any) -> dict[int, Any]:
    """The payloads of every pending job, claimed by the worker's own hot path (``Store.finish_and_claim``)."""
    store = Store(engine, app.queue, app.queue.driver(engine), "payload-test", 60.0, None)
    try:
        jobs, _, _ = store.finish_and_claim([], 100, uuid.uuid4().hex, False)
    finally:
        store.close()
    return {job.id: job.payload for job in jobs}


def _enqueue(engine: Any) -> dict[int, Any]:
    with Session(engine) as session, session.begin():
        jobs = [app.Job(kind="noop", payload=p) for p in PAYLOADS]
        session.add_all(jobs)
        session.flush()
        return {job.id: p for job, p in zip(jobs, PAYLOADS, strict=True)}


def _read_by_json_loads(engine: Any) -> dict[int, Any]:
    """Each job's payload as psycopg's own loader (``json.loads``) reads it: the reference."""
    with engine.connect() as conn:
        return dict(conn.execute(select(app.Job.id, app.Job.payload)).all())


def test_claimed_payloads_are_what_json_loads_makes_of_them_and_an_engines_deserializer_is_kept(
        pg: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    app.queue.create_tables(pg.engine)
    sent = _enqueue(pg.engine)
    expected = _read_by_json_loads(pg.engine)
    assert expected.keys() == sent.keys()
    psycopgs: list[Any] = []
    default_load = psycopg.types.json.JsonbLoader.load
    monkeypatch.setattr(psycopg.types.json.JsonbLoader, "load",
                        lambda self, data: psycopgs.append(data) or default_load(self, data))
    got = _claim_all(pg.engine)
    assert psycopgs == []  # the claim's cursor read them with its own loader
    assert got == expected
    assert repr(got) == repr(expected)  # the same types too (an int stays an int, a float a float)
    monkeypatch.undo()

    # An engine given its own json_deserializer: the claim reads the payloads with it, as before.
    with Session(pg.engine) as session, session.begin():
        session.query(app.Job).update({"state": "pending"})
    engine = create_engine(pg.url, json_deserializer=lambda text: {"read by": "the app", **json.loads(text)})
    try:
        got = _claim_all(engine)
    finally:
        engine.dispose()
    assert got == {job_id: {"read by": "the app", **payload} for job_id, payload in expected.items()}
