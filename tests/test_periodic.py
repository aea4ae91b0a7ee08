"""Periodic jobs: slots from cron or an interval, one job per slot however many workers, missed-slot policy."""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from sqla_jobs import ConfigError, JobQueue
from tests import app, forkserver
from tests.conftest import ROOT, Database
from tests.helpers import count, run_burst

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)


def scheduled(**options: object) -> JobQueue[app.Job, app.DeadJob]:
    queue: JobQueue[app.Job, app.DeadJob] = JobQueue(app.Job, app.DeadJob, check_kinds=False)
    queue.handler("noop")(app.noop)
    queue.handler("fail")(app.fail)
    options.setdefault("kind", "noop")
    queue.periodic(**options)  # type: ignore[arg-type]
    return queue


def slot_keys(db: Database) -> list[str]:
    with db.engine.connect() as conn:
        rows = conn.execute(select(app.Job.unique_key).where(app.Job.unique_key.is_not(None)))
        return sorted(str(k) for k in rows.scalars())


def test_one_job_per_slot_and_a_finished_slot_stays_done(db: Database) -> None:
    queue = scheduled(every=60, name="minutely")
    [job] = queue.enqueue_periodic(db.engine, now=T0 + timedelta(seconds=150))
    assert job.unique_key == "periodic:minutely@2026-11-30T12:02:00Z"
    assert queue.enqueue_periodic(db.engine, now=T0 + timedelta(seconds=170)) == []  # same slot
    run_burst(db.engine, queue)
    assert queue.enqueue_periodic(db.engine, now=T0 + timedelta(seconds=175)) == []  # finished: still done
    assert len(queue.enqueue_periodic(db.engine, now=T0 + timedelta(seconds=181))) == 1  # the next slot
    assert slot_keys(db) == ["periodic:minutely@2026-11-30T12:02:00Z", "periodic:minutely@2026-11-30T12:03:00Z"]


def test_missed_slots_once_or_skip(db: Database) -> None:
    # Down from 12:00 to 12:07:40: "once" runs the latest missed slot (12:05) once, "skip" waits for 12:10.
    once = scheduled(every=300, name="once")
    skip = scheduled(every=300, name="skip", missed="skip")
    back = T0 + timedelta(minutes=7, seconds=40)
    assert [j.unique_key for j in once.enqueue_periodic(db.engine, now=back)] == ["periodic:once@2026-11-30T12:05:00Z"]
    assert skip.enqueue_periodic(db.engine, now=back) == []
    assert len(skip.enqueue_periodic(db.engine, now=T0 + timedelta(minutes=10, seconds=1))) == 1
    # A slot older than catch_up is not caught up.
    late = scheduled(every=3600, name="hourly", catch_up=600)
    assert late.enqueue_periodic(db.engine, now=T0 + timedelta(minutes=11)) == []
    assert len(late.enqueue_periodic(db.engine, now=T0 + timedelta(minutes=9))) == 1


def test_a_dead_lettered_slot_is_not_enqueued_again(db: Database) -> None:
    queue = scheduled(every=60, kind="fail", name="failing", max_attempts=1)
    now = T0 + timedelta(seconds=5)
    [job] = queue.enqueue_periodic(db.engine, now=now)
    run_burst(db.engine, queue)
    assert count(db.engine, app.Job) == 0 and count(db.engine, app.DeadJob) == 1
    assert queue.enqueue_periodic(db.engine, now=now + timedelta(seconds=10)) == []
    with Session(db.engine) as session:
        assert session.get(app.DeadJob, job.id).unique_key == "periodic:failing@2026-11-30T12:00:00Z"


def test_cron_in_a_time_zone() -> None:
    queue = scheduled(cron="30 2 * * *", tz="Europe/Paris", name="nightly")
    schedule = queue.schedules["nightly"]
    slot = schedule.latest_slot(T0)  # 12:00 UTC: the last 02:30 in Paris was 01:30 UTC that day
    assert slot == datetime(2026, 11, 30, 1, 30, tzinfo=timezone.utc)
    assert schedule.next_slot(T0) == datetime(2026, 12, 1, 1, 30, tzinfo=timezone.utc)
    every5 = scheduled(cron="*/5 * * * *", tz="UTC").schedules["noop"]
    assert every5.latest_slot(T0 + timedelta(minutes=4, seconds=59)) == T0
    assert every5.latest_slot(T0 + timedelta(minutes=5)) == T0 + timedelta(minutes=5)


@pytest.mark.parametrize(("options", "message"), [
    ({"cron": "*/5 * * * *"}, "pass tz="),
    ({"cron": "*/5 * * *", "tz": "UTC"}, "not a cron expression"),
    ({"cron": "*/5 * * * *", "tz": "Mars/Olympus"}, "unknown time zone"),
    ({"every": 0.5}, "at least 1 second"),
    ({"every": 60, "tz": "UTC"}, "intervals count from the Unix epoch"),
    ({}, "either a cron expression or every="),
    ({"every": 60, "missed": "twice"}, "missed= must be one of once, skip"),
    ({"every": 60, "colour": "red"}, "unknown job field(s) colour"),
])
def test_bad_schedules_say_what_to_pass(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        scheduled(**options)


def test_two_schedules_of_one_kind_need_names() -> None:
    queue = scheduled(every=60)
    with pytest.raises(ConfigError, match="give this one name="):
        queue.periodic(every=120, kind="noop")


def _workers(db: Database, app_name: str, n: int, flavour: str = "threaded") -> list[forkserver.Popen]:
    command = [sys.executable, "-m", "sqla_jobs.cli", "worker", "--app", f"tests.periodic_app:{app_name}",
               "--poll-interval", "0.2", "--concurrency", "2", *(["--async"] if flavour == "async" else [])]
    workers = [forkserver.Popen(command, env=db.env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True) for _ in range(n)]
    for worker in workers:  # up and running (signals handled) before the test's clock starts
        assert worker.stderr is not None
        while "started" not in (line := worker.stderr.readline()):
            assert line, f"worker exited before it started: {worker.wait()}"
    return workers


def _stop(workers: list[forkserver.Popen]) -> None:
    for worker in workers:
        worker.send_signal(signal.SIGTERM)
    for worker in workers:
        _, err = worker.communicate(timeout=60)
        assert worker.returncode == 0, err


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["threaded", "async"])
def test_four_worker_processes_with_restarts_enqueue_each_slot_once(db: Database, flavour: str) -> None:
    """Every 2 s, 4 workers, 2 of them restarted midway, then the schedule removed: one job per slot
    (with the threaded workers, and with the async ones: their scheduler thread is the same)."""
    first = _workers(db, "queue", 4, flavour)
    time.sleep(7)
    _stop(first[:2])
    restarted = _workers(db, "queue", 2, flavour)
    time.sleep(7)
    _stop(first[2:] + restarted)
    keys = slot_keys(db)
    # The schedule removed from the code: workers of that app enqueue nothing more.
    removed = _workers(db, "without", 2, flavour)
    time.sleep(4)
    _stop(removed)
    assert slot_keys(db) == keys

    assert keys and all(k.startswith("periodic:tick@") for k in keys)
    per_slot = Counter(keys)
    assert set(per_slot.values()) == {1}, per_slot
    slots = sorted(datetime.strptime(k.split("@")[1], "%Y-%m-%dT%H:%M:%SZ") for k in keys)
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(slots)]
    # Slots follow each other while workers are up, across the restart too. (A gap of several
    # periods would mean every worker stalled for a whole period, on a badly overloaded machine:
    # the policy then runs only the latest missed slot, which is no duplicate.)
    assert all(gap % 2 == 0 for gap in gaps) and gaps.count(2.0) >= len(gaps) - 1, slots
    assert len(slots) >= 5
    with db.engine.connect() as conn:
        runs = conn.execute(text("SELECT job_id, COUNT(*) FROM effects WHERE event = 'start' GROUP BY job_id")).all()
        states = Counter(conn.execute(select(app.Job.state)).scalars())
    assert {n for _, n in runs} == {1} and len(runs) == len(keys)  # each slot's job ran once
    assert states == {"finished": len(keys)}


def test_pruning_sooner_than_catch_up_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    from sqlalchemy import create_engine

    from sqla_jobs._periodic import Scheduler

    queue = scheduled(every=60, name="minutely")
    with caplog.at_level("WARNING", logger="sqla_jobs.periodic"):
        Scheduler(queue, create_engine("sqlite://"), prune_after=3600)
    assert "sooner than its catch_up of 86400s" in caplog.text and "catch_up=3600" in caplog.text


def test_decorating_another_function_for_a_handled_kind_is_refused() -> None:
    queue = scheduled(every=60)

    with pytest.raises(ConfigError, match="decorate that one"):
        @queue.periodic(every=120, kind="noop", name="other")
        def not_the_handler(payload: dict[str, object]) -> None: ...


def test_periodic_stacks_on_a_handler_with_options() -> None:
    queue: JobQueue[app.Job, app.DeadJob] = JobQueue(app.Job, app.DeadJob, check_kinds=False)

    @queue.periodic(every=60, kind="report")
    @queue.handler("report", timeout=5)
    def report(payload: dict[str, object]) -> None: ...

    assert queue.handlers["report"].timeout == 5 and "report" in queue.schedules
