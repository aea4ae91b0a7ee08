"""Fair queues' claim (``Driver.claim_fair``, sqla_jobs._fair): keys take turns, weights give more turns."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import insert

from sqla_jobs.drivers.base import Claimed
from tests.drivers.conftest import Backend

PAST = datetime(2020, 1, 1, tzinfo=timezone.utc)
KEYS = st.sampled_from(["a", "b", "c", "d", "e", None])


class Claimer:
    """One claimer of a fair queue, with its cursor, as a worker holds it."""

    def __init__(self, backend: Backend, weights: dict[str, int] | None = None) -> None:
        self.backend, self.weights, self.cursor = backend, weights or {}, ""

    def claim(self, limit: int) -> list[Claimed]:
        with self.backend.write() as conn:
            jobs, _, self.cursor = self.backend.driver.claim_fair(
                conn, "fair", self.weights, self.cursor, limit, "conformance", uuid.uuid4().hex, 60.0, False)
        return jobs


def enqueue(backend: Backend, keys: list[str | None], queue: str = "fair", **fields: Any) -> dict[int, str | None]:
    """One job per entry of ``keys``, in that order (ids ascending); returns {id: key}."""
    t = backend.driver.jobs
    ids: dict[int, str | None] = {}
    with backend.write() as conn:
        for key in keys:
            row = {"kind": "noop", "queue": queue, "payload": {}, "run_at": PAST, "fair_key": key, **fields}
            ids[conn.execute(insert(t).values(**row)).inserted_primary_key[0]] = key
    return ids


def empty(backend: Backend) -> None:
    with backend.write() as conn:
        conn.execute(backend.driver.jobs.delete())


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(KEYS, min_size=1, max_size=14), st.integers(1, 5))
def test_keys_take_turns_round_robin(backend: Backend, keys: list[str | None], limit: int) -> None:
    """Whatever the backlog of each key, and in whatever order it came, the claims go round the keys: a key
    is served again only after every other key that still had jobs was served, and every job runs once."""
    empty(backend)
    ids = enqueue(backend, sorted(keys, key=lambda k: (k is not None, k or "")))  # the worst case for FIFO
    claimer = Claimer(backend)
    served: list[str | None] = []
    while batch := claimer.claim(limit):
        assert len(batch) <= limit
        served += [ids[j.id] for j in batch]
    assert Counter(served) == Counter(keys)
    left = Counter(keys)
    for i, key in enumerate(served):
        left[key] -= 1
        later = served[i + 1:]
        if key in later:  # before its next turn, every key that still had jobs had one
            between = set(later[:later.index(key)])
            assert {k for k, n in left.items() if n > 0} - {key} <= between, (served, i)
    distinct = len(set(keys))
    assert len(set(served[:distinct])) == distinct  # the first claims cover every key before any repeats


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.integers(0, 7), min_size=1),
       st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(1, 3)))
def test_weights_give_a_key_more_turns(backend: Backend, counts: dict[str, int], weights: dict[str, int]) -> None:
    """A key of weight w takes up to w jobs a turn: in claim order, its (w+1)-th job comes after every other
    key has had its own turn."""
    empty(backend)
    ids = enqueue(backend, [k for k, n in sorted(counts.items()) for _ in range(n)])
    served = [ids[j.id] for j in Claimer(backend, weights).claim(sum(counts.values()) + 1)]
    assert Counter(served) == Counter({k: n for k, n in counts.items() if n})
    for key, n in counts.items():
        w = weights.get(key, 1)
        if n > w:
            position = [i for i, k in enumerate(served) if k == key][w]
            before = Counter(served[:position])
            assert all(before[other] >= min(weights.get(other, 1), m) for other, m in counts.items()), served


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["b", "d", None]), min_size=1, max_size=8), st.sampled_from(["a", "c", "e"]),
       st.integers(1, 4))
def test_a_cursor_on_a_key_with_no_jobs_left_goes_round_the_others(
    backend: Backend, keys: list[str | None], cursor: str, limit: int
) -> None:
    """The key a worker served last may have no job left (the ring wraps back to that key unread on PostgreSQL):
    the claims still go round the keys after it, then those before it, and take every job once."""
    empty(backend)
    ids = enqueue(backend, keys)
    claimer = Claimer(backend)
    claimer.cursor = cursor
    first = claimer.claim(limit)
    served = [ids[j.id] for j in first]
    while batch := claimer.claim(limit):
        served += [ids[j.id] for j in batch]
    assert Counter(served) == Counter(keys)
    keyed = sorted({k for k in keys if k is not None})
    ring = [k for k in keyed if k > cursor] + [k for k in keyed if k < cursor]
    turns = [k for k in dict.fromkeys(ids[j.id] for j in first) if k is not None]  # the first claim's keys
    assert turns == ring[:len(turns)], (turns, ring)


def test_only_the_queue_its_due_jobs_and_the_plain_claim_leaves_fair_queues(backend: Backend) -> None:
    fair = enqueue(backend, ["a", None, "b"])
    enqueue(backend, ["a"], queue="other")
    enqueue(backend, ["a"], run_at=datetime.now(timezone.utc) + timedelta(hours=1))
    assert sorted(j.id for j in Claimer(backend).claim(10)) == sorted(fair)
    assert Claimer(backend).claim(10) == []
    plain = backend.driver.skipping_queues(["fair"])
    other = enqueue(backend, ["c"])
    with plain.write(backend.db.engine) as conn:
        taken = plain.claim(conn, 10, "conformance", uuid.uuid4().hex, 60.0, None)
    assert [j.queue for j in taken] == ["other"] and not set(other) & {j.id for j in taken}


def test_concurrent_claimers_take_each_job_once(backend: Backend) -> None:
    ids = enqueue(backend, [f"k{i % 7}" if i % 5 else None for i in range(140)])
    taken: list[int] = []
    lock = threading.Lock()

    def run() -> None:
        claimer = Claimer(backend)
        while True:
            try:
                batch = claimer.claim(4)
            except Exception as exc:  # SQLite's single writer: a busy database is tried again
                if "locked" not in str(exc):
                    raise
                continue
            if not batch:
                return
            with lock:
                taken.extend(j.id for j in batch)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(taken) == sorted(ids)


def test_an_isolated_job_is_claimed_alone(backend: Backend) -> None:
    """The plain claim's poison rule holds in a fair queue: a busy claimer leaves an isolated job and says so;
    an idle one takes it and nothing else."""
    ids = enqueue(backend, ["a", "b", "c"])
    isolated = min(ids)
    backend.set(isolated, isolate=True)

    def claim(alone: bool) -> tuple[list[Claimed], bool]:
        with backend.write() as conn:
            jobs, waiting, _ = backend.driver.claim_fair(conn, "fair", {}, "", 10, "conformance", uuid.uuid4().hex,
                                                         60.0, alone)
        return jobs, waiting

    jobs, waiting = claim(alone=False)
    assert sorted(j.id for j in jobs) == sorted(set(ids) - {isolated}) and waiting
    jobs, waiting = claim(alone=True)
    assert [j.id for j in jobs] == [isolated] and jobs[0].isolated and not waiting
