"""``sqla-jobs worker --processes N``: a supervisor that restarts a worker process that dies.

A poison job kills its worker process on every attempt. The supervisor starts
another process each time and hands the dead process's job back at once (the
lost attempt counts; tests/reliability/test_poison.py covers the rule), so it
is dead-lettered, the other jobs keep running, and SIGTERM stops everything
with exit status 0.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from sqlalchemy import text

from tests import app, forkserver
from tests.conftest import ROOT, Database
from tests.helpers import count, dead, enqueue


def wait_until(condition: object, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_supervisor_restarts_a_dead_worker_process_and_stops_on_sigterm(db: Database) -> None:
    poison = enqueue(db.engine, "suicide", max_attempts=2)
    command = [sys.executable, "-m", "sqla_jobs.cli", "worker", "--app", "tests.app:queue", "--processes", "2",
               "--concurrency", "2", "--lease", "1", "--heartbeat", "0.3", "--poll-interval", "0.1"]
    supervisor = forkserver.Popen(command, env=db.env(), cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: dead(db.engine, poison) is not None, 60, "the poison job to be dead-lettered")
        row = dead(db.engine, poison)
        assert row is not None and row.attempts == 2 and "WorkerLost" in (row.last_error or "")
        later = enqueue(db.engine, "noop")
        wait_until(lambda: count(db.engine, app.Job, app.Job.id == later, app.Job.state == "finished") == 1,
                   30, "a job enqueued after the crashes to run")
        assert supervisor.poll() is None, "the supervisor exited on its own"
        if db.backend == "postgresql":
            # The supervisor handed the dead child's job back on its own engine, hardened like the workers'
            # (keepalives, timeouts, application_name): the connection it keeps is named for it.
            with db.engine.connect() as conn:
                names = conn.execute(text("SELECT application_name FROM pg_stat_activity "
                                          "WHERE datname = current_database()")).scalars().all()
            assert any(n.startswith("sqla-jobs worker") and n.endswith(" supervisor") for n in names), names
    finally:
        supervisor.send_signal(signal.SIGTERM)
        _, stderr = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 0, stderr
    assert stderr.count("starting another") >= 2, stderr  # each attempt killed a process, each was replaced
