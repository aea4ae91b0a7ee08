"""Payload edges (issue 9, findings 3 and 4): depth, tuples, huge ints, edge floats, unicode.

Accepted means the handler gets back what docs/howto/enqueue.md promises; refused
means InvalidJob naming the path, at construction, at flush and in enqueue_many,
and the business row of the same transaction is rolled back with it.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from sqla_jobs import MAX_PAYLOAD_DEPTH, InvalidJob
from tests import app
from tests.conftest import Database
from tests.helpers import count


def deep(levels: int, leaf: Any = 1) -> dict[str, Any]:
    """A payload nested ``levels`` deep (the payload itself is level 1), lists and dicts in turn."""
    value: Any = leaf
    for i in range(levels - 1):
        value = [value] if i % 2 == 0 else {"k": value}
    return {"a": value}


def stored(db: Database, job_id: int) -> dict[str, Any]:
    with Session(db.engine) as session:
        return session.execute(select(app.Job.payload).where(app.Job.id == job_id)).scalar_one()


def documented(value: Any, backend: str) -> Any:
    """What docs/howto/enqueue.md says comes back: jsonb turns floats of 1e16 and more into
    the int their repr spells, and -0.0 into 0.0; SQLite gives every value back as sent."""
    if isinstance(value, dict):
        return {k: documented(v, backend) for k, v in value.items()}
    if isinstance(value, list):
        return [documented(v, backend) for v in value]
    if backend == "postgresql" and type(value) is float:
        if abs(value) >= 1e16:
            return int(Decimal(repr(value)))
        return 0.0 if value == 0 else value
    return value


def identical(a: Any, b: Any) -> bool:
    """Equal, with the same types and float signs (``==`` alone says 1e16 == 10**16 and -0.0 == 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return repr(a) == repr(b)
    return bool(a == b)


def refusal(value: Any, depth: int = 1) -> str | None:
    """The documented rules, written independently of sqla_jobs._payload: why ``value`` is refused."""
    if isinstance(value, dict):
        if depth > MAX_PAYLOAD_DEPTH:
            return "nested deeper"
        for key, item in value.items():
            reason = ("non-string key" if not isinstance(key, str) else refusal(key)) or refusal(item, depth + 1)
            if reason:
                return reason
        return None
    if isinstance(value, list):
        if depth > MAX_PAYLOAD_DEPTH:
            return "nested deeper"
        return next((r for r in (refusal(v, depth + 1) for v in value) if r), None)
    if isinstance(value, tuple):
        return "tuple"
    if isinstance(value, str):
        if "\x00" in value:
            return "\\u0000"
        return None if not any(0xD800 <= ord(c) <= 0xDFFF for c in value) else "lone surrogate"
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return None if -(2**63) <= value < 2**63 else "64-bit"
    if isinstance(value, float):
        return None if math.isfinite(value) else "NaN or infinity"
    return "JSON cannot store"


# -- the finding repros ----------------------------------------------------------------------------


def test_990_deep_list_is_invalid_job_at_construction_not_recursion_error() -> None:
    with pytest.raises(InvalidJob, match=rf"nested deeper than {MAX_PAYLOAD_DEPTH} levels") as raised:
        app.Job(kind="noop", payload={"a": deep(990)["a"]})
    assert str(raised.value).startswith("Job.payload['a'][0]['k'][0]")


def test_20000_deep_list_is_refused_too() -> None:
    value: Any = 1
    for _ in range(20_000):
        value = [value]
    with pytest.raises(InvalidJob, match="nested deeper"):
        app.Job(kind="noop", payload={"a": value})


def test_deep_payload_set_in_place_fails_at_flush_with_the_business_row(db: Database) -> None:
    payload: dict[str, Any] = {"ok": 1}
    with pytest.raises(InvalidJob, match="nested deeper"), Session(db.engine) as session, session.begin():
        session.add(app.Once(job_id=-1))
        session.add(app.Job(kind="noop", payload=payload))
        payload["late"] = deep(990)["a"]  # in place: only the flush sees it
    assert count(db.engine, app.Once) == 0
    assert count(db.engine, app.Job) == 0


def test_deep_payload_in_enqueue_many_is_refused_before_anything_is_written(db: Database) -> None:
    expected = r"Job\.payload\['a'\]\[0\].* nested deeper"
    with pytest.raises(InvalidJob, match=expected), Session(db.engine) as session, session.begin():
        session.add(app.Once(job_id=-1))
        app.queue.enqueue_many(session, [{"kind": "noop"}, {"kind": "noop", "payload": deep(990)}])
    assert count(db.engine, app.Once) == 0
    assert count(db.engine, app.Job) == 0


def test_the_deepest_allowed_payload_round_trips_and_one_more_level_is_refused(db: Database) -> None:
    with Session(db.engine) as session, session.begin():
        job = app.Job(kind="noop", payload=deep(MAX_PAYLOAD_DEPTH))
        session.add(job)
        session.flush()
        job_id = job.id
    assert stored(db, job_id) == deep(MAX_PAYLOAD_DEPTH)
    with pytest.raises(InvalidJob, match="nested deeper"):
        app.Job(kind="noop", payload=deep(MAX_PAYLOAD_DEPTH + 1))


def test_circular_payload_is_named_as_such() -> None:
    inner: list[Any] = []
    inner.append({"again": inner})
    with pytest.raises(InvalidJob, match=r"Job\.payload\['x'\].*contains itself"):
        app.Job(kind="noop", payload={"x": inner})


@pytest.mark.parametrize("where", ["construction", "flush", "enqueue_many"])
def test_tuples_are_refused_everywhere(db: Database, where: str) -> None:
    payload: dict[str, Any] = {"a": [0, {"t": (None, None)}]}
    expected = r"Job\.payload\['a'\]\[1\]\['t'\] is a tuple.*pass list\(value\)"
    with pytest.raises(InvalidJob, match=expected), Session(db.engine) as session, session.begin():
        session.add(app.Once(job_id=-1))
        if where == "construction":
            session.add(app.Job(kind="noop", payload=payload))
        elif where == "flush":
            later: dict[str, Any] = {}
            session.add(app.Job(kind="noop", payload=later))
            later.update(payload)
        else:
            app.queue.enqueue_many(session, [{"kind": "noop", "payload": payload}])
    assert count(db.engine, app.Once) == 0


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**30, 10**5000], ids=["2**63", "-2**63-1", "1e30", "1e5000"])
def test_ints_outside_64_bits_are_refused(value: int) -> None:
    with pytest.raises(InvalidJob, match=r"Job\.payload\['n'\] is an int of \d+ bits, outside the 64-bit range"):
        app.Job(kind="noop", payload={"n": value})


@pytest.mark.parametrize("value", [object(), Decimal("1.10")])
def test_error_grammar_and_advice(value: Any) -> None:
    with pytest.raises(InvalidJob) as raised:
        app.Job(kind="noop", payload={"v": value})
    message = str(raised.value)
    assert " a object" not in message and " a int" not in message
    if isinstance(value, Decimal):
        assert "is a Decimal" in message and "str(value)" in message and "isoformat" not in message
    else:
        assert "is an object" in message


EDGE_FLOATS = [1e16, -1e16, 1e23, 5e-324, -0.0, 0.0, 1.7976931348623157e308, 2.2250738585072014e-308, 0.1, 1e-7]


def test_edge_floats_and_ints_round_trip_exactly_as_documented(db: Database) -> None:
    payload = {"f": EDGE_FLOATS, "i": [2**63 - 1, -(2**63), 0], "s": "é😀\u2028\x7f\n\"\\"}
    with Session(db.engine) as session, session.begin():
        job = app.Job(kind="noop", payload=payload)
        session.add(job)
        session.flush()
        job_id = job.id
    back = stored(db, job_id)
    assert identical(back, documented(payload, db.backend))
    assert [float(x) for x in back["f"]] == EDGE_FLOATS  # float() gives every float back, bit for bit
    if db.backend == "postgresql":
        assert back["f"][2] == 10**23 and back["f"][2] != 1e23  # not "equal in value": the docs say so
        assert math.copysign(1, back["f"][4]) == 1  # -0.0 loses its sign in jsonb
    else:
        assert math.copysign(1, back["f"][4]) == -1


def test_the_orm_path_encodes_each_payload_once(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """The text made at flush is the one sent: neither validation nor SQLAlchemy encodes it again."""
    from sqla_jobs import _payload

    ours: list[int] = []
    sqlalchemy_calls: list[int] = []
    real = _payload._dumps
    monkeypatch.setattr(_payload, "_dumps", lambda p: (ours.append(1), real(p))[1])
    engine = create_engine(db.url, json_serializer=lambda v: (sqlalchemy_calls.append(1), json.dumps(v))[1])
    try:
        with Session(engine) as session, session.begin():
            session.add_all(app.Job(kind="noop", payload={"n": i, "s": "x" * i}) for i in range(50))
        assert len(ours) == 50
        assert sqlalchemy_calls == []
        with Session(engine) as session:
            rows = session.scalars(select(app.Job.payload).order_by(app.Job.id)).all()
        assert rows == [{"n": i, "s": "x" * i} for i in range(50)]
    finally:
        engine.dispose()


# -- properties ------------------------------------------------------------------------------------

any_text = st.text(max_size=8) | st.sampled_from(["\ud800", "caf\udce9", "a\x00b", "\ud83d\ude00", "é😀"])
keys = any_text | st.integers(min_value=0, max_value=2)
leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([*EDGE_FLOATS, math.nan, math.inf])
    | any_text
)
values = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(keys, children, max_size=3)
    | st.tuples(children, children),
    max_leaves=10,
)


@st.composite
def payloads(draw: st.DrawFn) -> dict[str, Any]:
    payload = draw(st.dictionaries(any_text, values, max_size=4))
    if draw(st.booleans()):  # sometimes a deep chain, around the documented limit
        payload["deep"] = deep(draw(st.integers(min_value=MAX_PAYLOAD_DEPTH - 3, max_value=MAX_PAYLOAD_DEPTH + 3)),
                               draw(leaves))["a"]
    return payload


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=payloads(), bulk=st.booleans())
def test_accepted_round_trips_as_documented_refused_is_invalid_job_and_the_business_row_follows(
    db: Database, payload: dict[str, Any], bulk: bool
) -> None:
    expected_refusal = refusal(payload)
    with Session(db.engine) as session:
        session.execute(app.Once.__table__.delete())
        session.execute(app.Job.__table__.delete())
        session.commit()
    try:
        with Session(db.engine) as session, session.begin():
            session.add(app.Once(job_id=1))
            if bulk:
                app.queue.enqueue_many(session, [{"kind": "noop", "payload": payload}])
            else:
                session.add(app.Job(kind="noop", payload=payload))
    except InvalidJob as exc:
        assert expected_refusal is not None, f"refused a storable payload: {exc}"
        assert str(exc).startswith("Job.payload")
        assert expected_refusal in str(exc)
        assert count(db.engine, app.Once) == 0
        assert count(db.engine, app.Job) == 0
        return
    assert expected_refusal is None, f"accepted a payload that should be refused ({expected_refusal})"
    assert count(db.engine, app.Once) == 1
    with Session(db.engine) as session:
        back = session.scalars(select(app.Job.payload)).one()
    assert identical(back, documented(payload, db.backend))


def test_payloads_bound_without_a_flush_are_encoded_as_before(db: Database) -> None:
    """Core statements (the worker's dead-letter move, an UPDATE) bind the dict itself: still plain JSON."""
    from sqlalchemy import insert

    with db.engine.begin() as conn:
        conn.execute(insert(app.Job.__table__).values(kind="noop", payload={"core": [1, "é"]}))
    with Session(db.engine) as session:
        assert session.scalars(select(app.Job.payload)).one() == {"core": [1, "é"]}
