"""Debounce and replace on unique keys: a duplicate enqueue can give the pending holder its payload
(``on_duplicate="replace"``) or also push its ``run_at`` out (``"debounce"``), atomically, on every backend.

The driver's statement is in tests/drivers/test_unique.py; here the public API, and the promise end to end:
enqueuers in several processes debouncing keys while four worker processes poll, and each key's job runs
once, after the last enqueue's delay, with the last enqueue's payload.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, delete, select
from sqlalchemy.orm import Session

from sqla_jobs import InvalidJob
from tests import app, forkserver
from tests.conftest import ROOT, Database
from tests.helpers import count, utc


def _later(seconds: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=seconds)


def test_keep_replace_and_debounce_on_a_pending_holder(db: Database) -> None:
    first_at = _later(60)
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        first = app.queue.enqueue_unique(session, "noop", {"n": 1}, unique_key="k", run_at=first_at)
        kept = app.queue.enqueue_unique(session, "noop", {"n": 2}, unique_key="k")
        assert (kept.inserted, kept.updated, kept.id, kept.job.payload) == (False, False, first.id, {"n": 1})
        replaced = app.queue.enqueue_unique(session, "noop", {"n": 3}, unique_key="k", on_duplicate="replace",
                                            run_at=_later(600))
        # replace gives the payload only: run_at stays
        assert (replaced.inserted, replaced.updated, replaced.id) == (False, True, first.id)
        assert replaced.job.payload == {"n": 3} and abs((utc(replaced.job.run_at) - first_at).total_seconds()) < 0.01
    pushed = _later(120)
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        debounced = app.queue.enqueue(session, "noop", {"n": 4}, unique_key="k", on_duplicate="debounce",
                                      run_at=pushed)
        assert debounced.id == first.id and debounced.payload == {"n": 4}
        # an earlier run_at never pulls the holder in: the job runs after the latest one asked for
        app.queue.enqueue(session, "noop", {"n": 5}, unique_key="k", on_duplicate="debounce", run_at=_later(1))
    with Session(db.engine) as session:
        job = session.get(app.Job, first.id)
        assert job is not None and job.payload == {"n": 5} and abs((utc(job.run_at) - pushed).total_seconds()) < 0.01
    assert count(db.engine, app.Job) == 1


BASE = datetime(2030, 1, 1, tzinfo=timezone.utc)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["keep", "replace", "debounce"]), st.integers(0, 10_000)),
                min_size=1, max_size=8))
def test_any_sequence_of_duplicates_leaves_the_payload_and_run_at_the_model_says(
        tmp_path: Path, calls: list[tuple[str, int]]) -> None:
    """The first call inserts; then keep changes nothing, replace the payload, debounce the payload and run_at
    (to the later of the two). SQLite here: the statements are the same on every backend (the driver suite)."""
    engine = create_engine(f"sqlite:///{tmp_path}/property.db")
    app.queue.create_tables(engine)
    with engine.begin() as conn:
        conn.execute(delete(app.Job.__table__))
    payload, run_at = None, None
    for n, (mode, seconds) in enumerate(calls):
        at = BASE + timedelta(seconds=seconds)
        with Session(engine, expire_on_commit=False) as session, session.begin():
            app.queue.enqueue_unique(session, "noop", {"n": n}, unique_key="k", on_duplicate=mode, run_at=at)
        if n == 0 or mode != "keep":
            payload = {"n": n}
        if n == 0 or (mode == "debounce" and at > run_at):  # type: ignore[operator]
            run_at = at
    with Session(engine) as session:
        [job] = session.scalars(select(app.Job)).all()
        assert (job.payload, utc(job.run_at)) == (payload, run_at)
    engine.dispose()


def test_a_running_holder_is_never_changed(db: Database) -> None:
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        held = app.queue.enqueue_unique(session, "noop", {"n": 1}, unique_key="k")
    with Session(db.engine) as session, session.begin():
        session.get(app.Job, held.id).state = "running"  # type: ignore[union-attr]
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        again = app.queue.enqueue_unique(session, "noop", {"n": 2}, unique_key="k", on_duplicate="debounce",
                                         run_at=_later(5))
    assert (again.inserted, again.updated, again.id, again.job.payload) == (False, False, held.id, {"n": 1})


def test_enqueue_many_items_choose_too(db: Database) -> None:
    with Session(db.engine) as session, session.begin():
        added = app.queue.enqueue_many(session, [
            {"kind": "noop", "payload": {"n": 1}, "unique_key": "a"},
            {"kind": "noop", "payload": {"n": 2}, "unique_key": "a", "on_duplicate": "replace"},
            {"kind": "noop", "payload": {"n": 1}, "unique_key": "b"},
            {"kind": "noop", "payload": {"n": 2}, "unique_key": "b", "on_duplicate": "keep"},
        ])
    assert added == 2  # inserted rows only: an updated holder is not counted
    with Session(db.engine) as session:
        got = dict(session.execute(select(app.Job.unique_key, app.Job.payload)).all())
    assert got == {"a": {"n": 2}, "b": {"n": 1}}


def test_bad_on_duplicate_is_refused_before_anything_is_written(db: Database) -> None:
    with Session(db.engine) as session, session.begin():
        with pytest.raises(InvalidJob, match="one of 'keep', 'replace', 'debounce'"):
            app.queue.enqueue_unique(session, "noop", {}, unique_key="k", on_duplicate="latest")
        with pytest.raises(InvalidJob, match="needs run_at"):
            app.queue.enqueue_unique(session, "noop", {}, unique_key="k", on_duplicate="debounce")
        with pytest.raises(InvalidJob, match="without a unique_key"):
            app.queue.enqueue(session, "noop", {}, on_duplicate="replace")
        with pytest.raises(InvalidJob, match="without a unique_key"):
            app.queue.enqueue_many(session, [{"kind": "noop", "on_duplicate": "replace"}])
        with pytest.raises(InvalidJob, match="needs run_at"):
            app.queue.enqueue_many(session, [{"kind": "noop", "unique_key": "k", "on_duplicate": "debounce"}])
    assert count(db.engine, app.Job) == 0


# Each enqueuer process: 4 threads, each debouncing every key again and again for 2 s, each call in
# its own transaction; then the process prints how many calls it made and the errors any of them raised
# (none may: a duplicate never fails the caller's transaction). On MariaDB, InnoDB may end one of two
# transactions racing on the same key's index entry with a deadlock, which rolls back the whole transaction:
# the caller retries it, as docs/howto/unique-jobs.md says (counted, and the run below must still be exactly once).
ENQUEUER = textwrap.dedent('''
    import os, sys, threading, time
    from datetime import datetime, timedelta, timezone
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session
    from tests import app

    keys, runs, delay, go = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]
    engine = create_engine(os.environ["SQLA_JOBS_URL"], pool_size=4,
                           **({"connect_args": {"timeout": 60}} if "sqlite" in os.environ["SQLA_JOBS_URL"] else {}))
    open(f"{go}.ready-{os.getpid()}", "w").close()
    while not os.path.exists(go):  # all enqueuers start together, however slowly each process came up
        time.sleep(0.01)
    until = time.time() + 2.0
    calls, errors = [], []

    def debounce(n):
        while time.time() < until:
            for key in range(keys):
                for _ in range(5):  # a MariaDB deadlock: the transaction was rolled back whole; retry it
                    try:
                        with Session(engine) as session, session.begin():
                            run_at = datetime.now(timezone.utc) + timedelta(seconds=delay)
                            app.queue.enqueue(session, "debounced", {"runs": runs, "n": f"{os.getpid()}-{n}"},
                                              unique_key=f"reindex-{key}", on_duplicate="debounce", run_at=run_at)
                        break
                    except Exception as exc:
                        if "1213" not in str(exc):
                            errors.append(repr(exc)[:300])
                            break
                else:
                    errors.append("five deadlocks in a row")
                calls.append(1)
            time.sleep(0.02)

    threads = [threading.Thread(target=debounce, args=(n,)) for n in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    print(len(calls), len(errors), errors[:3])
''')


def _keep_debouncing(db: Database, keys: int, runs: Path, delay: float, stop: threading.Event) -> None:
    while not stop.wait(0.2):
        with Session(db.engine) as session, session.begin():
            for key in range(keys):
                app.queue.enqueue(session, "debounced", {"runs": str(runs), "n": "keeper"},
                                  unique_key=f"reindex-{key}", on_duplicate="debounce", run_at=_later(delay))


@pytest.mark.slow
def test_debounced_keys_run_once_after_the_last_enqueue_under_four_workers(db: Database, tmp_path: Path) -> None:
    keys, delay = 4, 4.0
    runs = tmp_path / "runs.txt"
    runs.touch()
    command = [sys.executable, "-m", "sqla_jobs.cli", "worker", "--app", "tests.app:queue",
               "--poll-interval", "0.05", "--concurrency", "4"]
    logs = [tmp_path / f"worker-{i}.log" for i in range(4)]
    workers = []
    for log in logs:
        with open(log, "w") as out:
            workers.append(forkserver.Popen(command, env=db.env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=out))
    try:
        go = tmp_path / "go"
        enqueuers = [forkserver.Popen([sys.executable, "-c", ENQUEUER, str(keys), str(runs), str(delay), str(go)],
                                      env=db.env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for _ in range(2)]
        ends = time.monotonic() + 60
        while len(list(tmp_path.glob("go.ready-*"))) < 2:
            assert time.monotonic() < ends and all(p.poll() is None for p in enqueuers), "enqueuers did not start"
            time.sleep(0.05)
        go.touch()
        # This process debounces too, until the last enqueue below: the jobs must not come due in the gap
        # between the enqueuers' end and that last enqueue (a loaded machine can make it seconds long).
        stop = threading.Event()
        keeper = threading.Thread(target=_keep_debouncing, args=(db, keys, runs, delay, stop))
        keeper.start()
        try:
            outs = [p.communicate(timeout=120) for p in enqueuers]
        finally:
            stop.set()
            keeper.join()
        for proc, (_, err) in zip(enqueuers, outs, strict=True):
            assert proc.returncode == 0, err
        calls = sum(int(out.split()[0]) for out, _ in outs)
        assert [out.split(maxsplit=1)[1] for out, _ in outs] == ["0 []\n", "0 []\n"], outs
        assert calls >= 2 * 4 * keys  # every thread debounced every key at least once
        # The last enqueue of each key, after all the concurrent ones: its payload is the one that must run.
        last_at = {}
        with Session(db.engine) as session, session.begin():
            for key in range(keys):
                last_at[key] = _later(delay)
                app.queue.enqueue(session, "debounced", {"runs": str(runs), "n": f"last-{key}"},
                                  unique_key=f"reindex-{key}", on_duplicate="debounce", run_at=last_at[key])
        ends = time.monotonic() + 60
        while len(runs.read_text().splitlines()) < keys and time.monotonic() < ends:
            time.sleep(0.1)
        time.sleep(1.0)  # a second run of any key would show up here
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    lines = [line.split() for line in runs.read_text().splitlines()]
    worker_logs = "\n".join(log.read_text()[-2000:] for log in logs)
    # one run per key, each with the last enqueue's payload, none before the last enqueue's run_at
    assert sorted(line[5] for line in lines) == [f"last-{key}" for key in range(keys)], (lines, worker_logs)
    for line in lines:
        key = int(line[5].split("-")[1])
        assert float(line[3]) >= last_at[key].timestamp() - 0.01, (line, last_at[key])
        assert line[1] == "1"  # the first attempt: nothing failed and ran again
    assert count(db.engine, app.Job) == keys
