"""Durable jobs under SIGKILL (docs/howto/durable.md, "Retries and crashes"): a worker process killed inside
each step of a 5-step job, and just after each, in turn. The supervisor (``--processes 2``) hands the
lost run back at once and starts a new process; a worker process runs the job again from the top.

A plain step's side effect happens at least once: exactly once when the process died after its
checkpoint, twice when it died inside the step (after the effect, before the checkpoint). A
transactional handler's steps write their effects through its session: exactly once wherever it died.
The same holds for the async worker (``worker --async``) running the ``async def`` twins of the
handlers, whose transactional steps write through the handler's AsyncSession.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from tests import durable_app, forkserver
from tests.conftest import ROOT, Database
from tests.helpers import effects, enqueue, job

# Serial: its worker processes are SIGKILLed over and over; in the parallel phase that load starved the
# timing-sensitive fault tests beside it (the relay's refusals, the fault matrix's outage and PgBouncer rows).
pytestmark = [pytest.mark.slow, pytest.mark.serial]

PLAIN = [f"{where}-s{i}" for i in range(5) for where in ("step", "after")]
TRANSACTIONAL = [f"{where}-t{i}" for i in range(5) for where in ("step", "after")]


#: Per worker: its extra option, the kinds of the plain and the transactional 5-step handlers (tests/durable_app.py).
WORKERS = {"threaded": ([], "d_steps", "d_tx"), "async": (["--async"], "d_async_steps", "d_async_tx")}


def _run(db: Database, kills: Path, option: list[str]) -> None:
    """One supervisor with two worker processes running one job at a time, each restarted after its kill, until no
    job is due."""
    worker = forkserver.Popen(
        [sys.executable, "-m", "sqla_jobs.cli", "--log-level", "INFO", "worker", *option, "--burst",
         "--processes", "2", "--concurrency", "1", "--poll-interval", "0.05", "--app", "tests.durable_app:queue"],
        env=db.env(SQLA_JOBS_TEST_KILL_DIR=str(kills)), cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    _, err = worker.communicate(timeout=300)
    assert worker.returncode == 0, err
    assert ("started (async)" in err) == ("--async" in option), err  # the worker it meant to kill


@pytest.mark.parametrize("flavour", WORKERS)
def test_a_worker_killed_in_and_after_each_step_repeats_only_the_step_it_died_in(db: Database, tmp_path: Path,
                                                                                  flavour: str) -> None:
    option, plain_kind, tx_kind = WORKERS[flavour]
    plain = {point: enqueue(db.engine, plain_kind, {"n": 5, "kill_at": point}) for point in PLAIN}
    tx = {point: enqueue(db.engine, tx_kind, {"n": 5, "kill_at": point}) for point in TRANSACTIONAL}
    kills = tmp_path / "kills"
    kills.mkdir()
    _run(db, kills, option)
    assert sorted(p.name for p in kills.iterdir()) == sorted(str(i) for i in [*plain.values(), *tx.values()])
    for point, job_id in plain.items():
        row = job(db.engine, job_id)
        assert row is not None and row.state == "finished" and row.attempts == 2, (point, row and row.last_error)
        assert row.result == [f"s{i}" for i in range(5)]
        runs = Counter(event for _, _, event in effects(db.engine, job_id) if event.startswith("step-"))
        died_in = point if point.startswith("step-") else None
        assert runs == {f"step-s{i}": 2 if f"step-s{i}" == died_in else 1 for i in range(5)}, point
    for point, job_id in tx.items():
        row = job(db.engine, job_id)
        assert row is not None and row.state == "finished" and row.result == "done", (point, row and row.last_error)
        runs = Counter(event for _, _, event in effects(db.engine, job_id))
        assert runs == {f"step-t{i}": 1 for i in range(5)}, point
        with Session(db.engine) as session:
            assert [s.name for s in durable_app.queue.job_steps(session, job_id)] == [f"t{i}" for i in range(5)]


def test_a_sleep_outlives_the_worker_that_parked_it_and_wakes_once(db: Database) -> None:
    """The worker that parked the job is stopped (SIGTERM) while it sleeps; another one, started later, resumes
    it at its due time: once, and the steps before the sleep do not run again."""
    job_id = enqueue(db.engine, "d_sleep", {"seconds": 3})
    command = [sys.executable, "-m", "sqla_jobs.cli", "--log-level", "WARNING", "worker", "--concurrency", "2",
               "--poll-interval", "0.1", "--app", "tests.durable_app:queue"]
    first = forkserver.Popen(command, env=db.env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 60
        while "step-before" not in [e for _, _, e in effects(db.engine, job_id)] and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        first.terminate()
        first.communicate(timeout=60)
    parked = job(db.engine, job_id)
    assert parked is not None and parked.state == "pending" and parked.attempts == 0
    second = forkserver.Popen(command, env=db.env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        deadline = time.monotonic() + 60
        while job(db.engine, job_id).state != "finished" and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.1)
    finally:
        second.terminate()
        second.communicate(timeout=60)
    done = job(db.engine, job_id)
    assert done is not None and done.state == "finished" and done.result == "woke" and done.attempts == 1
    assert [e for _, _, e in effects(db.engine, job_id) if e.startswith("step-")] == ["step-before", "step-after"]
