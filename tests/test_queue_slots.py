"""Per-queue slots in one worker: ``Worker(queues={"slow": 2, "fast": 2})``, ``--queue slow=2 --queue fast=2``."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from sqla_jobs import ConfigError, Worker
from tests import forkserver
from tests.app import Effect, Job, queue
from tests.conftest import ROOT, Database, run_cli
from tests.test_operations import APP, _wait_for


def enqueue_in(db: Database, name: str, kind: str, n: int, **payload: Any) -> list[int]:
    with Session(db.engine) as session, session.begin():
        jobs = [queue.enqueue(session, kind, dict(payload), queue=name) for _ in range(n)]
        session.flush()
        return [job.id for job in jobs]


def events(db: Database, job_ids: list[int]) -> list[tuple[int, str]]:
    """(job id, start|finish) in the order the handlers recorded them."""
    with Session(db.engine) as session:
        rows = session.execute(select(Effect.job_id, Effect.event).where(Effect.job_id.in_(job_ids))
                               .order_by(Effect.id))
        return [(r.job_id, r.event) for r in rows]


def most_at_once(db: Database, job_ids: list[int]) -> int:
    running = peak = 0
    for _, event in events(db, job_ids):
        running += 1 if event == "start" else -1
        peak = max(peak, running)
    return peak


def test_a_busy_queue_does_not_delay_another(db: Database) -> None:
    """A worker process with three slots for the slow queue and one for the fast one: the slow queue
    (enqueued first, so first in claim order) fills its own three threads and no more; the fast queue's
    jobs run meanwhile on theirs. With one shared pool of four threads they would wait behind the slow jobs."""
    slow = enqueue_in(db, "slow", "sleep", 7, seconds=1.5)
    fast = enqueue_in(db, "fast", "record", 6)
    proc = forkserver.Popen(
        [sys.executable, "-m", "sqla_jobs.cli", "worker", *APP, "--queue", "slow=3", "--queue", "fast=1",
         "--poll-interval", "0.05"],
        env=db.env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        _wait_for(lambda: sum(e == "finish" for _, e in events(db, fast)) == len(fast))
        slow_done_meanwhile = sum(e == "finish" for _, e in events(db, slow))
        _wait_for(lambda: sum(e == "finish" for _, e in events(db, slow)) == len(slow), timeout=60)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "concurrency 4 (slow=3, fast=1)" in out
    # All fast jobs ran before even the first batch of slow ones ended (without slots they wait for it).
    assert slow_done_meanwhile < 3, f"fast jobs waited for {slow_done_meanwhile} slow ones"
    assert most_at_once(db, slow) == 3  # the slow queue used its three slots, never the fast queue's
    assert most_at_once(db, fast) == 1


def test_each_queue_is_claimed_in_batches(db: Database) -> None:
    with Session(db.engine) as session, session.begin():
        queue.enqueue_many(session, [{"kind": "noop", "queue": name} for name in ("a", "b") for _ in range(60)])
    worker = Worker(db.engine, queue, queues={"a": 8, "b": 8}, poll_interval=0.05)
    worker.run(burst=True, install_signals=False)
    assert worker.processed == 120
    # An internal counter (no public handle): one claim per job would be 120 round trips.
    assert worker._control._claims <= 40, worker._control._claims


def test_plain_queue_names_share_the_threads(db: Database) -> None:
    taken = enqueue_in(db, "a", "noop", 2) + enqueue_in(db, "b", "noop", 2)
    left = enqueue_in(db, "c", "noop", 2)
    result = run_cli("worker", *APP, "--queue", "a", "--queue", "b", "--burst", "--poll-interval", "0.05",
                     env=db.env())
    assert result.returncode == 0, result.stderr
    with Session(db.engine) as session:
        states = {job_id: state for job_id, state in session.execute(select(Job.id, Job.state))}
    assert {states[i] for i in taken} == {"finished"} and {states[i] for i in left} == {"pending"}
    assert "concurrency 4, lease" in result.stderr  # shared threads: no per-queue slots


@pytest.mark.parametrize(("args", "message"), [
    (["--queue", "a=0"], "--queue 'a=0': SLOTS must be a whole number >= 1"),
    (["--queue", "a=two"], "SLOTS must be a whole number >= 1, e.g. --queue a=2"),
    (["--queue", "a=2", "--queue", "b"], "--queue 'b' has no slots while others do"),
    (["--queue", "a", "--queue", "a"], "--queue 'a' is given twice"),
    (["--queue", "a", "--queues", "b"], "give queues with --queue (repeatable) or --queues, not both"),
    (["--queue", "a=2", "--queue", "b=2", "--concurrency", "3"],
     "concurrency (3) must be the sum of the queues' slots (4)"),
    (["--queue", "=2"], "give a queue name"),
])
def test_bad_queue_options_say_what_to_do(args: list[str], message: str) -> None:
    result = run_cli("worker", "--app", "tests.app:queue", "--url", "sqlite://", *args)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_bad_slots_in_python(db: Database) -> None:
    with pytest.raises(ConfigError, match="queue 'a' needs at least 1 slot, got 0"):
        Worker(db.engine, queue, queues={"a": 0})
    with pytest.raises(ConfigError, match="not the string 'emails'"):
        Worker(db.engine, queue, queues="emails")
    with pytest.raises(ConfigError, match=r"concurrency \(2\) must be the sum"):
        Worker(db.engine, queue, queues={"a": 2, "b": 1}, concurrency=2)
    worker = Worker(db.engine, queue, queues={"a": 2, "b": 1})
    assert (worker.config.concurrency, worker.config.queues, worker.config.slots) == (3, ("a", "b"), {"a": 2, "b": 1})


def test_a_job_that_must_run_alone_runs_alone_with_slots(db: Database) -> None:
    """A job whose last worker was lost runs alone in its process (docs/guarantees.md), whichever
    queue's slots it comes through: no job of another queue runs beside it."""
    from sqlalchemy import update

    [alone] = enqueue_in(db, "a", "sleep", 1, seconds=0.5)  # "a" is claimed first in a turn
    others = enqueue_in(db, "a", "sleep", 3, seconds=0.3) + enqueue_in(db, "b", "sleep", 2, seconds=0.3)
    with Session(db.engine) as session, session.begin():
        session.execute(update(Job).where(Job.id == alone).values(isolate=True, priority=10))
    Worker(db.engine, queue, queues={"a": 2, "b": 2}, poll_interval=0.05).run(burst=True, install_signals=False)
    order = events(db, [alone, *others])
    start, finish = order.index((alone, "start")), order.index((alone, "finish"))
    assert finish == start + 1, order  # nothing started or finished while it ran
    assert len(order) == 12
