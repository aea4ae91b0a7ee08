"""Worker subprocesses, waiting helpers and the invariant checker of the fault-injection suite.

Every scenario ends with :func:`check_invariants`: each job the test enqueued
is finished, pending, running under a live lease, or dead-lettered (nothing
else, never missing); no job was reported finished twice by any worker; and
the handlers' effects match: a finished ``record``/``sleep`` job has a finish
effect, a ``once`` job has exactly one Once row if and only if it finished.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, String, create_engine, literal, select, text, union_all
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from tests import app, forkserver
from tests.conftest import MARIADB_URL, ROOT

FINISHED_LINE = re.compile(r"job (\d+) \S+ attempt \d+/\d+ \([\d.]+ ms\): finished$", re.M)

# Short leases so a lost worker is noticed in seconds; all flags are the CLI's own.
FAST = {"lease": 2.0, "heartbeat": 0.5, "grace": 5.0, "poll_interval": 0.2}
#: The lease of a ``Worker`` made only to run its reaper once (``Worker._reap``). Short: the reaper leaves every
#: lease alone for a lease after the database server started (``Driver.expired``), and CI restarts PostgreSQL
#: (for max_connections) a minute before the suite, so the default 60 s would make such a test's reap a no-op.
REAP_LEASE = 2.0


@dataclass
class WorkerProc:
    """One ``sqla-jobs worker`` subprocess with its log in a file."""

    url: str
    log_path: Path
    options: dict[str, Any] = field(default_factory=dict)
    handler_url: str | None = None  # the handlers' own database URL, when not the worker's (behind a proxy)
    proc: forkserver.Popen | None = None

    def start(self) -> WorkerProc:
        opts = {**FAST, "concurrency": 2, **self.options}
        args = [sys.executable, "-m", "sqla_jobs.cli", "--log-level", "INFO", "worker",
                "--app", "tests.app:queue", "--url", self.url]
        for key, value in opts.items():
            if value is True:
                args.append(f"--{key.replace('_', '-')}")
            elif value is not False and value is not None:
                args += [f"--{key.replace('_', '-')}", str(value)]
        env = {**os.environ, "SQLA_JOBS_URL": self.handler_url or self.url, "PYTHONPATH": str(ROOT)}
        env.pop("SQLA_JOBS_APP", None)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in wait()
        self.proc = forkserver.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        """Through the process handle, never ``os.kill(pid)``: once the worker has exited its pid may be
        another process's (the suite wraps the pid space within minutes), a database server's included."""
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.returncode is not None:
                self._log.close()

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit in time (then the test fails on the code)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.wait(10)
            raise AssertionError(f"worker {self.pid} did not stop within {timeout}s; log:\n{self.log()}") from None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def started(self) -> bool:
        """Whether it has said it started (past its imports, its stop signals handled)."""
        return re.search(r"worker \S+ started", self.log()) is not None


def terminate_backends(engine: Engine, pid: int) -> int:
    """PostgreSQL: ``pg_terminate_backend`` on every connection worker process ``pid`` opened (found by the
    application_name workers give them); how many."""
    with engine.connect() as conn:
        killed = conn.execute(
            text("select pg_terminate_backend(pid) from pg_stat_activity where application_name like :name"),
            {"name": f"sqla-jobs worker %:{pid}:%"},
        ).scalars().all()
    return len(killed)


def kill_tcp_connections(database: str) -> int:
    """MariaDB: ``KILL`` every TCP connection to ``database`` (the workers'; unix-socket ones are spared);
    how many."""
    admin = create_engine(MARIADB_URL)
    try:
        with admin.connect() as conn:
            ids = conn.execute(
                text("SELECT id FROM information_schema.processlist WHERE db = :db AND host LIKE '%:%' "
                     "AND id <> CONNECTION_ID()"),
                {"db": database},
            ).scalars().all()
            for connection_id in ids:
                with suppress(DBAPIError):  # closed meanwhile
                    conn.execute(text(f"KILL {int(connection_id)}"))
        return len(ids)
    finally:
        admin.dispose()


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def enqueue(engine: Engine, kind: str, payload: dict[str, Any] | None = None, n: int = 1, **fields: Any) -> list[int]:
    with Session(engine) as session:
        jobs = [app.queue.enqueue(session, kind, payload or {}, **fields) for _ in range(n)]
        session.commit()
        return [job.id for job in jobs]


def job(engine: Engine, job_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(app.Job.__table__).where(app.Job.id == job_id)).first()


def dead(engine: Engine, job_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(app.DeadJob.__table__).where(app.DeadJob.id == job_id)).first()


def effects(engine: Engine, job_id: int | None = None, event: str | None = None) -> list[Any]:
    stmt = select(app.Effect.__table__).order_by(app.Effect.id)
    if job_id is not None:
        stmt = stmt.where(app.Effect.job_id == job_id)
    if event is not None:
        stmt = stmt.where(app.Effect.event == event)
    with engine.connect() as conn:
        return list(conn.execute(stmt))


def states(engine: Engine, ids: Iterable[int]) -> dict[int, str]:
    """``finished``/``pending``/``running``/``cancelled`` from the jobs table, ``dead`` from dead letters."""
    ids = list(ids)
    # One statement, so one snapshot: two reads in READ COMMITTED could straddle a dead-letter move's
    # commit and see the job in both tables although no committed state ever had it twice.
    both = union_all(
        select(app.Job.id, app.Job.state).where(app.Job.id.in_(ids)),
        select(app.DeadJob.id, literal("dead", String)).where(app.DeadJob.id.in_(ids)),
    )
    found: dict[int, str] = {}
    with engine.connect() as conn:
        for job_id, state in conn.execute(both):
            assert job_id not in found, f"job {job_id} is both in the jobs table and dead-lettered"
            found[job_id] = state
    return found


def all_settled(engine: Engine, ids: Iterable[int]) -> bool:
    return all(s in ("finished", "dead") for s in states(engine, ids).values())


def check_invariants(engine: Engine, ids: Iterable[int], logs: Iterable[str] = ()) -> dict[int, str]:
    """The suite's invariants; returns each job's final state for further asserts."""
    ids = list(ids)
    table = app.Job.__table__
    with engine.connect() as conn:
        db_now = conn.execute(select(app.queue.driver(conn).now())).scalar_one()
        rows = {r.id: r for r in conn.execute(select(table).where(table.c.id.in_(ids)))}
        once_rows = Counter(conn.execute(select(app.Once.job_id).where(app.Once.job_id.in_(ids))).scalars())
    found = states(engine, ids)
    missing = sorted(set(ids) - set(found))
    assert not missing, f"jobs lost (neither in the jobs table nor dead-lettered): {missing}"
    for job_id, state in found.items():
        assert state in ("finished", "pending", "running", "dead"), f"job {job_id} ended {state!r}"
        if state == "running":
            row = rows[job_id]
            expires = row.lease_expires_at
            if isinstance(db_now, str):  # SQLite: text from strftime, naive UTC like the stored value
                db_now = datetime.fromisoformat(db_now)
            live = expires is not None and expires > db_now
            assert live, f"job {job_id} is running under an expired lease ({expires} <= {db_now}): stuck"
            assert row.claim_token, f"job {job_id} is running without a claim token"
        else:
            row = rows.get(job_id)
            if row is not None:
                assert row.claim_token is None or state == "finished", f"job {job_id} {state} keeps a claim token"

    finishes = Counter(int(m) for text in logs for m in FINISHED_LINE.findall(text))
    twice = {job_id: n for job_id, n in finishes.items() if n > 1}
    assert not twice, f"jobs reported finished more than once: {twice}"
    wrongly = sorted(job_id for job_id in finishes if job_id in found and found[job_id] != "finished")
    assert not wrongly, f"workers reported these finished but they are not: {wrongly}"

    finish_effects = {e.job_id for e in effects(engine, event="finish")}
    for job_id, state in found.items():
        kind = rows[job_id].kind if job_id in rows else None
        if state == "finished" and kind in ("record", "sleep", "relay", "async_record"):
            assert job_id in finish_effects, f"job {job_id} finished without its handler finishing"
        if kind in ("once", "once_slow", "async_once") or once_rows.get(job_id):
            expected = 1 if state == "finished" else 0
            assert once_rows.get(job_id, 0) == expected, (
                f"once job {job_id} is {state} with {once_rows.get(job_id, 0)} Once row(s), expected {expected}")
    return found
