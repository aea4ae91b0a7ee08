"""Limits across workers: the claim of limited kinds (``drivers._limits.claim_limited``) on every backend."""

from __future__ import annotations

import json
import threading
import uuid
from datetime import datetime, timezone
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, select, update

from sqla_jobs._limits import KindLimit, ensure_limits_table, limits_table
from sqla_jobs.drivers._limits import claim_limited, ensure_rows
from sqla_jobs.drivers.base import Claimed
from tests import app
from tests.drivers.conftest import Backend, at_once, in_write

PAST = datetime(2020, 1, 1, tzinfo=timezone.utc)


def limited(backend: Backend, limits: list[KindLimit], free: int = 10, *, alone: bool = False,
            queues: list[str] | None = None) -> tuple[list[Claimed], bool, bool]:
    table = limits_table(app.queue)
    ensure_limits_table(backend.db.engine, table)
    with backend.write() as conn:
        return claim_limited(backend.driver, conn, table, limits, free, "conformance", uuid.uuid4().hex, 60.0,
                             queues, alone)


def payloads(backend: Backend, kind: str, items: list[dict[str, Any]]) -> list[int]:
    ids = backend.insert(len(items), kind=kind, run_at=PAST)
    t = backend.driver.jobs
    with backend.write() as conn:
        for job_id, payload in zip(ids, items, strict=True):
            conn.execute(update(t).where(t.c.id == job_id).values(payload=payload))
    return ids


def finish(backend: Backend, jobs: list[Claimed]) -> None:
    in_write(backend, lambda conn: backend.driver.finish(conn, [j.fence for j in jobs]))


def test_the_ordinary_claim_skips_limited_kinds(backend: Backend) -> None:
    plain = backend.insert(2, run_at=PAST)
    backend.insert(3, kind="capped", run_at=PAST)
    got = in_write(backend, lambda conn: backend.driver.claim(conn, 10, "w", "t", 60.0, None, skip_kinds=["capped"]))
    assert sorted(j.id for j in got) == plain
    fused = in_write(backend, lambda conn: backend.driver.finish_and_claim(
        conn, [], 10, "w", "t2", 60.0, None, skip_kinds=["capped"]))
    assert fused[1] == []


def test_at_most_n_running_of_a_kind(backend: Backend) -> None:
    ids = backend.insert(10, kind="capped", run_at=PAST)
    other = backend.insert(2, run_at=PAST)
    cap = KindLimit("capped", running=3)
    first, _, _ = limited(backend, [cap])
    assert [j.id for j in first] == ids[:3]  # in claim order
    assert all(j.attempt == 1 and j.kind == "capped" for j in first)
    assert limited(backend, [cap])[0] == []  # full: the others wait
    for job_id in ids[3:]:
        row = backend.row(job_id)
        assert (row.state, row.attempts) == ("pending", 0)  # waiting burns no attempt
    finish(backend, first[:2])
    assert [j.id for j in limited(backend, [cap])[0]] == ids[3:5]
    assert [j.id for j in limited(backend, [cap], free=1)[0]] == []  # 3 running again
    assert all(backend.row(i).state == "pending" for i in other)  # other kinds are not this claim's


def test_a_limit_per_payload_key(backend: Backend) -> None:
    items = [{"customer": "a"}] * 4 + [{"customer": "b"}] * 4 + [{"customer": 7}] * 3 + [{}] * 3
    ids = payloads(backend, "per_customer", items)
    cap = KindLimit("per_customer", running=2, key="customer")
    got, _, _ = limited(backend, [cap], free=100)
    by_key: dict[str, int] = {}
    for job in got:
        key = str(job.payload.get("customer", ""))
        by_key[key] = by_key.get(key, 0) + 1
    assert by_key == {"a": 2, "b": 2, "7": 2, "": 2}  # a missing field is a key of its own
    assert limited(backend, [cap], free=100)[0] == []
    finish(backend, [j for j in got if j.payload.get("customer") == "b"])
    again = limited(backend, [cap], free=100)[0]
    assert [j.payload["customer"] for j in again] == ["b", "b"]
    assert {j.id for j in got + again} <= set(ids)


def test_full_keys_do_not_hide_free_ones_behind_them(backend: Backend) -> None:
    busy = payloads(backend, "per_customer", [{"customer": "busy"}] * 30)
    free_key = payloads(backend, "per_customer", [{"customer": "idle"}])
    cap = KindLimit("per_customer", running=1, key="customer")
    assert [j.id for j in limited(backend, [cap], free=1)[0]] == busy[:1]
    assert [j.id for j in limited(backend, [cap], free=1)[0]] == free_key


def test_a_rate_lets_n_start_then_waits(backend: Backend) -> None:
    ids = backend.insert(6, kind="paced", run_at=PAST)
    rate = KindLimit("paced", rate_count=4, rate_period=3600.0)
    first = limited(backend, [rate], free=3)[0]
    assert [j.id for j in first] == ids[:3]
    assert [j.id for j in limited(backend, [rate], free=3)[0]] == ids[3:4]  # one token left
    finish(backend, first)  # finishing frees no token: a rate counts starts
    assert limited(backend, [rate])[0] == []
    table = limits_table(app.queue)
    with backend.db.engine.connect() as conn:
        tokens = conn.execute(select(table.c.tokens).where(table.c.name == "kind:paced")).scalar()
    assert tokens is not None and 0 <= tokens < 1
    assert all(backend.row(i).attempts == 0 for i in ids[4:])


def test_a_rate_refills_with_the_database_clock(backend: Backend) -> None:
    ids = backend.insert(5, kind="paced", run_at=PAST)
    rate = KindLimit("paced", rate_count=2, rate_period=3600.0)
    assert len(limited(backend, [rate])[0]) == 2
    table = limits_table(app.queue)
    with backend.write() as conn:  # an hour and a half ago: 3 tokens' worth, capped at 2
        conn.execute(update(table).where(table.c.name == "kind:paced")
                     .values(updated_at=backend.driver.ago(5400.0)))
    assert [j.id for j in limited(backend, [rate])[0]] == ids[2:4]


def test_limit_and_rate_together_and_two_kinds(backend: Backend) -> None:
    backend.insert(5, kind="capped", run_at=PAST)
    backend.insert(5, kind="paced", run_at=PAST)
    both = [KindLimit("capped", running=2, rate_count=1, rate_period=3600.0), KindLimit("paced", running=3)]
    got = limited(backend, both)[0]
    assert sorted(j.kind for j in got) == ["capped", "paced", "paced", "paced"]
    assert len(limited(backend, both, free=2)[0]) == 0


def test_queues_and_free_threads_bound_the_claim(backend: Backend) -> None:
    backend.insert(3, kind="capped", queue="a", run_at=PAST)
    b = backend.insert(3, kind="capped", queue="b", run_at=PAST)
    cap = KindLimit("capped", running=5)
    assert [j.id for j in limited(backend, [cap], free=2, queues=["b"])[0]] == b[:2]


def test_an_isolated_job_of_a_limited_kind_runs_alone(backend: Backend) -> None:
    ids = backend.insert(3, kind="capped", run_at=PAST)
    backend.set(ids[1], isolate=True)
    cap = KindLimit("capped", running=3)
    got, waiting, lone = limited(backend, [cap])
    assert ([j.id for j in got], waiting, lone) == ([ids[0], ids[2]], True, False)
    finish(backend, got)
    got, waiting, lone = limited(backend, [cap], alone=True)
    assert ([j.id for j in got], waiting, lone) == ([ids[1]], False, True)
    assert got[0].isolated


def _race(backend: Backend, cap: KindLimit, claimers: int) -> list[list[Claimed]]:
    """``claimers`` threads claim at the same instant; each one's batch."""
    outcomes = at_once([lambda: limited(backend, [cap], free=2)[0]] * claimers)
    assert not [o for o in outcomes if isinstance(o, Exception)], outcomes
    return outcomes


def test_concurrent_claimers_never_exceed_the_limit(backend: Backend) -> None:
    """8 claimers start at once, round after round: exactly the limit runs, never more (the row lock).

    Without the lock PostgreSQL and MariaDB let each claimer count the same running jobs: 10 or more.
    """
    backend.insert(200, kind="capped", run_at=PAST)
    cap = KindLimit("capped", running=3)
    limited(backend, [cap], free=0)  # the table exists before the threads race
    for _ in range(3):
        results = _race(backend, cap, 8)
        claimed = [j for batch in results for j in batch]
        assert len(claimed) == 3, [len(b) for b in results]
        finish(backend, claimed)


def test_claimers_racing_on_a_kind_whose_row_is_missing_never_deadlock(backend: Backend) -> None:
    """The first claims of a kind ever make its limits row; 8 at once, for 12 fresh kinds: no error, one row
    each, the limit held. (InnoDB ended one of them with a deadlock in CI: a loser of the INSERT held a shared
    lock on the winner's row, then asked for the exclusive one behind the others' requests.)"""
    ensure_limits_table(backend.db.engine, limits_table(app.queue))  # the table, not the kinds' rows
    for round_ in range(12):
        kind = f"fresh{round_}"
        backend.insert(4, kind=kind, run_at=PAST)
        cap = KindLimit(kind, running=2)
        claimed = [j for batch in _race(backend, cap, 8) for j in batch]
        assert len(claimed) == 2, kind
    with backend.db.engine.connect() as conn:
        names = conn.scalars(select(limits_table(app.queue).c.name)).all()
    assert sorted(names) == sorted(f"kind:fresh{r}" for r in range(12))


def test_the_limits_row_is_made_once(backend: Backend) -> None:
    backend.insert(1, kind="capped", run_at=PAST)
    for _ in range(2):
        limited(backend, [KindLimit("capped", running=1)])
    table = limits_table(app.queue)
    with backend.db.engine.connect() as conn:
        rows = conn.execute(select(table.c.name, table.c.tokens)).all()
    assert [tuple(r) for r in rows] == [("kind:capped", None)]
    assert json.dumps(rows[0][0])  # plain text


def test_workers_starting_together_all_make_sure_of_the_rows(backend: Backend) -> None:
    """Eight workers start at once and each makes sure of the same missing rows: every one of them gets
    through (should the database end one as a deadlock, it runs again), and each row is made once."""
    table = limits_table(app.queue)
    ensure_limits_table(backend.db.engine, table)
    names = ["kind:capped"]
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def start() -> None:
        engine = create_engine(backend.db.url)  # a worker process's own connections
        try:
            barrier.wait()
            ensure_rows(backend.driver, engine, table, names)
        except BaseException as exc:
            errors.append(exc)
        finally:
            engine.dispose()

    for _ in range(10):  # rounds: the race is not lost every time
        with backend.write() as conn:
            conn.execute(table.delete())
        threads = [threading.Thread(target=start) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "a start hung on the limits rows"
        assert errors == []
        with backend.db.engine.connect() as conn:
            assert sorted(conn.execute(select(table.c.name)).scalars()) == names


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 3), st.lists(st.sampled_from("abc"), min_size=1, max_size=12),
       st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=6))
def test_any_claims_and_finishes_keep_every_key_within_its_limit(
        backend: Backend, n: int, keys: list[str], steps: list[tuple[int, int]]) -> None:
    """Claims of any size between finishes of any number: never more than ``n`` running per key, and a claim
    with free threads takes something whenever some key with room has a job due."""
    with backend.write() as conn:  # each example starts from an empty queue
        conn.execute(backend.driver.jobs.delete())
    payloads(backend, "per_customer", [{"customer": k} for k in keys])
    cap = KindLimit("per_customer", running=n, key="customer")
    running: list[Claimed] = []
    for free, finishing in steps:
        with backend.db.engine.connect() as conn:
            t = backend.driver.jobs
            pending = [r.payload["customer"] for r in conn.execute(
                select(t.c.payload).where(t.c.state == "pending", t.c.kind == "per_customer"))]
        room = {k: n - sum(j.payload["customer"] == k for j in running) for k in "abc"}
        claimable = any(room[k] > 0 for k in pending)
        got = limited(backend, [cap], free=free)[0]
        assert len(got) <= free
        if free and claimable:
            assert got, (room, pending)
        running += got
        for k in "abc":
            assert sum(j.payload["customer"] == k for j in running) <= n
        done, running = running[:finishing], running[finishing:]
        finish(backend, done)


def test_postgresql_takes_nothing_without_the_lock_its_first_statement_passed_up(backend: Backend) -> None:
    """PostgreSQL's two statements (drivers/postgresql/capped.py) run one at a time: the lock, skipped as the kind is
    at its limit; a finish committed by another worker; then the take, which now sees room but must not use
    it, since this transaction does not hold the kind's row (another claimer might be counting under it)."""
    if backend.name != "postgresql":
        return
    from sqla_jobs.drivers.postgresql import capped as pg_limits

    backend.insert(3, kind="capped", run_at=PAST)
    cap = KindLimit("capped", running=1)
    table = limits_table(app.queue)
    ensure_limits_table(backend.db.engine, table)
    ensure_rows(backend.driver, backend.db.engine, table, [cap.row])  # (a missing row also means no lock)
    first, _, _ = limited(backend, [cap])  # one running: the kind is at its limit
    assert len(first) == 1
    with backend.write() as conn:
        stmts = pg_limits.statements(conn, backend.driver.jobs, table, False,
                                     backend.driver._pg_hot_for(conn, None))  # type: ignore[attr-defined]
        params = {"row": cap.row, "kind": "capped", "running": 1, "budget": 5, "worker": "w", "token": "t-gate",
                  "lease": 60.0, "queues": [], "alone": False}
        assert pg_limits._rows(conn, [(stmts.lock, params)], False) == [[]]  # not worth locking: no lock
        finish(backend, first)  # another transaction: room for one
        taken = pg_limits._rows(conn, [(stmts.take, params)], False)
    assert taken == [[]]
    assert len(limited(backend, [cap])[0]) == 1  # with the lock, the room is used
