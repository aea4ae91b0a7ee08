"""Properties checked with hypothesis: the backoff schedule and payload validation."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session

from sqla_jobs import Backoff, InvalidJob
from tests import app
from tests.conftest import Database

# -- backoff ---------------------------------------------------------------------------------------

failures = st.integers(min_value=1, max_value=10_000)
policies = st.builds(
    Backoff,
    base=st.floats(min_value=0, max_value=1e6),
    factor=st.floats(min_value=1, max_value=100),
    cap=st.floats(min_value=0, max_value=1e7),
    jitter=st.floats(min_value=0, max_value=0.99),
)


def test_default_schedule_is_1_2_4_8_minutes_then_the_hour_cap() -> None:
    default = Backoff()
    assert [default.nominal(n) / 60 for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]


@given(failures)
def test_default_nominal_is_one_minute_doubled_per_failure(n: int) -> None:
    assert Backoff().nominal(n) == min(3600.0, 60.0 * 2 ** min(n - 1, 20))


@given(policies, failures)
def test_nominal_is_monotone_and_capped(policy: Backoff, n: int) -> None:
    assert policy.nominal(n) <= policy.nominal(n + 1) <= policy.cap


@given(policies, failures, st.integers())
def test_jitter_stays_in_bounds_and_under_the_cap(policy: Backoff, n: int, seed: int) -> None:
    delay = policy.delay(n, random.Random(seed))
    nominal = policy.nominal(n)
    assert delay <= policy.cap
    assert nominal * (1 - policy.jitter) - 1e-9 <= delay <= nominal * (1 + policy.jitter) + 1e-9


@given(failures, st.integers())
def test_default_delay_is_within_ten_percent(n: int, seed: int) -> None:
    nominal = Backoff().nominal(n)
    assert 0.9 * nominal - 1e-9 <= Backoff().delay(n, random.Random(seed)) <= min(3600.0, 1.1 * nominal)


@pytest.mark.parametrize(
    "kwargs", [{"base": -1}, {"cap": -1}, {"factor": 0.5}, {"jitter": 1}, {"jitter": -0.1}]
)
def test_invalid_policy_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="Backoff"):
        Backoff(**kwargs)


def test_failures_count_from_one() -> None:
    with pytest.raises(ValueError, match="counts from 1"):
        Backoff().nominal(0)


# -- payloads --------------------------------------------------------------------------------------

# Valid Unicode without NUL: no surrogate code points (category Cs), which are not valid on their own.
safe_text = st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=20)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    # jsonb keeps numbers as decimals: see test_huge_floats_come_back_equal_but_as_int_on_postgres.
    | st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: abs(x) < 1e16)
    | safe_text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(safe_text, children, max_size=4),
    max_leaves=15,
)
json_payloads = st.dictionaries(safe_text, json_values, max_size=5)

poisons = st.sampled_from([math.nan, math.inf, -math.inf, "a\x00b", "\x00", "caf\udce9", "\ud800"]) | st.builds(
    lambda key: {key: 1}, st.sampled_from([1, 2.5, None, True, "k\x00", "\udfff"])
)


@st.composite
def poisoned_payloads(draw: st.DrawFn) -> dict[str, Any]:
    """A JSON-safe payload with one bad value planted somewhere inside it."""
    bad: Any = draw(poisons)
    for wrap in draw(st.lists(st.sampled_from(["list", "dict"]), max_size=3)):
        bad = [bad] if wrap == "list" else {"inner": bad}
    payload = draw(json_payloads)
    payload[draw(safe_text)] = bad
    return payload


def round_trip(db: Database, payload: dict[str, Any]) -> dict[str, Any]:
    """Enqueue ``payload`` and read it back from the database."""
    with Session(db.engine) as session, session.begin():
        job = app.Job(kind="noop", payload=payload)
        session.add(job)
        session.flush()
        job_id = job.id
    with Session(db.engine) as session:
        stored = session.get(app.Job, job_id)
        assert stored is not None
        return stored.payload


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=json_payloads)
def test_json_safe_payloads_round_trip_unchanged(db: Database, payload: dict[str, Any]) -> None:
    assert round_trip(db, payload) == payload


@settings(max_examples=200)
@given(payload=poisoned_payloads())
def test_payloads_with_nan_inf_nul_or_non_string_keys_are_refused(payload: dict[str, Any]) -> None:
    with pytest.raises(InvalidJob, match=r"Job\.payload"):
        app.Job(kind="noop", payload=payload)


@settings(max_examples=200)
@given(payload=json_payloads)
def test_json_safe_payloads_pass_validation(payload: dict[str, Any]) -> None:
    assert app.Job(kind="noop", payload=payload).payload is payload  # the validator raises on a bad one


def test_huge_floats_come_back_equal_but_as_int_on_postgres(db: Database) -> None:
    """jsonb stores numbers as decimals and prints 1e16 as 10000000000000000: Python reads an int back."""
    payload = {"big": 1e16, "odd": 2.988103430978887e16, "small": 1e-5, "one": 1.0}
    stored = round_trip(db, payload)
    assert {k: float(v) for k, v in stored.items()} == payload  # same value as a float, always
    assert (stored["small"], stored["one"]) == (1e-5, 1.0)
    expected_type = int if db.backend == "postgresql" else float
    assert type(stored["big"]) is expected_type
    assert type(stored["odd"]) is expected_type
