"""The app the tests run workers against, in-process and as ``--app tests.app:queue``.

Handlers record what they do in the ``effects`` table (one row per start and
per finish, with the attempt and the worker's pid), so tests can check
exactly what ran, how often, and where. The database is ``SQLA_JOBS_URL``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, DateTime, Engine, Integer, String, UniqueConstraint, create_engine, func, insert
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqla_jobs import Backoff, DeadJobMixin, JobCancel, JobMixin, JobQueue, JobSnooze, current_job


class Base(DeclarativeBase):
    pass


class Job(JobMixin, Base):
    __tablename__ = "jobs"


class DeadJob(DeadJobMixin, Base):
    __tablename__ = "dead_jobs"


class Effect(Base):
    """One row per handler start or finish."""

    __tablename__ = "effects"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True)
    job_id: Mapped[int] = mapped_column(BigInteger)
    attempt: Mapped[int] = mapped_column(Integer)
    event: Mapped[str] = mapped_column(String(16))
    pid: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class Once(Base):
    """A unique key on job id: a second completed run of one job cannot commit."""

    __tablename__ = "once"
    job_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    __table_args__ = (UniqueConstraint("job_id", name="uq_once_job_id"),)


# Retries come quickly in tests; individual tests override per kind where they need to.
queue: JobQueue[Job, DeadJob] = JobQueue(Job, DeadJob, backoff=Backoff(base=0.0, jitter=0.0))

_engine: Engine | None = None
_lock = threading.Lock()


def engine() -> Engine:
    """The handlers' own engine (an app would have its own too)."""
    global _engine
    with _lock:
        if _engine is None:
            url = os.environ["SQLA_JOBS_URL"]
            # SQLite: 48 handler threads share one write lock with the workers; on a loaded machine
            # the driver's 5 s default wait is too short, and a "database is locked" would be a
            # (charged) handler failure, which the exactly-once tests would count as a second attempt.
            options: dict[str, Any] = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
            # As many connections as the default pool allows at once (5 + 10 overflow), all kept: with the
            # overflow, every connection a handler returned beyond the fifth was closed and the next handler
            # opened a new one, and those connects were two thirds of a worker process's CPU.
            _engine = create_engine(url, pool_size=15, max_overflow=0, **options)
        return _engine


def record(event: str) -> None:
    job = current_job()
    with engine().begin() as conn:
        conn.execute(insert(Effect).values(job_id=job.id, attempt=job.attempt, event=event, pid=os.getpid()))


async def arecord(event: str) -> None:
    """``record`` from an async handler: on a thread, since a sync write that waits for SQLite's lock
    on the event loop's thread would stop the very transactions that hold the lock."""
    await asyncio.to_thread(record, event)


@queue.handler("noop")
def noop(payload: dict[str, Any]) -> None:
    pass


@queue.handler("heap")
def heap(payload: dict[str, Any]) -> dict[str, bool]:
    """Whether the garbage collector still scans this app's objects (its queue among them): those the worker
    process froze after start-up are in none of the generations ``gc.get_objects()`` lists."""
    return {"queue_scanned": any(obj is queue for obj in gc.get_objects())}


@queue.handler("record")
def record_run(payload: dict[str, Any]) -> None:
    record("start")
    if payload.get("sleep"):
        time.sleep(payload["sleep"])
    record("finish")


@queue.handler("once", transactional=True)
def once(payload: dict[str, Any]) -> None:
    """Exactly-once: the Once row commits with the job's completion, or not at all."""
    job = current_job()
    assert job.session is not None
    job.session.add(Once(job_id=job.id))
    if payload.get("sleep"):
        time.sleep(payload["sleep"])


@queue.handler("fail")
def fail(payload: dict[str, Any]) -> None:
    raise ValueError(payload.get("message", "boom"))


@queue.handler("flaky")
def flaky(payload: dict[str, Any]) -> None:
    if current_job().attempt < payload["succeed_on"]:
        raise ConnectionError(f"attempt {current_job().attempt} failed")


@queue.handler("sleep")
def sleep(payload: dict[str, Any]) -> None:
    record("start")
    deadline = time.monotonic() + payload["seconds"]
    while time.monotonic() < deadline:
        time.sleep(0.01)
    record("finish")


def log_run(path: str, started: float, *extra: str) -> None:
    """Append this run (job id, attempt, pid, start, end: the wall clock, then ``extra``) to the file ``path``:
    a record a database outage during the run cannot lose or hold up."""
    job = current_job()
    with open(path, "a") as runs:
        runs.write(" ".join(map(str, (job.id, job.attempt, os.getpid(), started, time.time(), *extra))) + "\n")


@queue.handler("timed")
def timed(payload: dict[str, Any]) -> None:
    """Sleeps ``sleep`` seconds (deaf to a cancel), then logs its run to ``payload["runs"]`` (``log_run``)."""
    started = time.time()
    time.sleep(payload.get("sleep", 0))
    log_run(payload["runs"], started)


@queue.handler("debounced")
def debounced(payload: dict[str, Any]) -> None:
    """Logs its run to ``payload["runs"]`` (``log_run``) with the payload's ``n``: which enqueue's payload ran."""
    log_run(payload["runs"], time.time(), str(payload["n"]))


@queue.handler("patient")
def patient(payload: dict[str, Any]) -> None:
    """Runs ``first`` seconds on attempt 1 and ``later`` on the others, or until told it is cancelled, then logs
    its run to ``payload["runs"]`` (``log_run``), ending with ``cancelled`` or ``done``."""
    job = current_job()
    started = time.time()
    job.cancelled.wait(payload["first"] if job.attempt == 1 else payload["later"])
    log_run(payload["runs"], started, "cancelled" if job.cancelled.is_set() else "done")


@queue.handler("hang", timeout=0.5)
def hang(payload: dict[str, Any]) -> None:
    record("start")
    time.sleep(payload.get("seconds", 3))
    record("finish")


@queue.handler("suicide")
def suicide(payload: dict[str, Any]) -> None:
    """A poison job: kills its own worker process every time."""
    record("start")
    os.kill(os.getpid(), signal.SIGKILL)


@queue.handler("poison")
def poison(payload: dict[str, Any]) -> None:
    """A poison job that ends its process the way a crash in native code or an OOM kill does:
    no exception, no cleanup, every other job of the process gone with it."""
    record("start")
    os._exit(1)


@queue.handler("snooze")
def snooze(payload: dict[str, Any]) -> None:
    if current_job().attempt == 1 and not payload.get("done"):
        raise JobSnooze(payload.get("seconds", 0))


@queue.handler("cancel")
def cancel(payload: dict[str, Any]) -> None:
    raise JobCancel("customer deleted")


@queue.handler("async_noop")
async def async_noop(payload: dict[str, Any]) -> None:
    record("finish")


@queue.handler("async_record")
async def async_record(payload: dict[str, Any]) -> None:
    """``record`` for the async worker: its pause awaits, so the loop runs other jobs meanwhile."""
    await arecord("start")
    await asyncio.sleep(payload.get("sleep", 0))
    await arecord("finish")


@queue.handler("async_once", transactional=True)
async def async_once(payload: dict[str, Any]) -> None:
    """``once_slow`` for the async worker: the Once row through its AsyncSession, flushed, a marker file,
    a pause to crash in; ``fail`` raises after all that (its writes must roll back)."""
    job = current_job()
    assert job.session is not None
    job.session.add(Once(job_id=job.id))
    await job.session.flush()  # type: ignore[misc]  # an AsyncSession under AsyncWorker
    if payload.get("marker"):
        with open(f"{payload['marker']}.{job.attempt}", "w"):
            pass
    await asyncio.sleep(payload.get("sleep", 0))
    if payload.get("fail"):
        raise ValueError("failed after writing")


@queue.handler("async_hang", timeout=0.5)
async def async_hang(payload: dict[str, Any]) -> None:
    """Runs past its timeout; records ``stopped`` when its task is cancelled (really stopped)."""
    await arecord("start")
    try:
        await asyncio.sleep(payload.get("seconds", 3))
    except asyncio.CancelledError:
        await asyncio.shield(arecord("stopped"))
        raise
    await arecord("finish")


@queue.handler("await_cancel")
def await_cancel(payload: dict[str, Any]) -> None:
    """Runs until someone requests its cancellation (at most 60 s), then fails or succeeds as
    ``payload["fail"]`` says: cancelling a running job, without racing a timer."""
    from sqlalchemy import select  # here, so the shared import block above stays as it is

    record("start")
    job_id = current_job().id
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with engine().connect() as conn:
            if conn.execute(select(Job.cancelled_at).where(Job.id == job_id)).scalar() is not None:
                break
        time.sleep(0.02)
    if payload.get("fail"):
        raise RuntimeError("failed after the cancel request")


_barriers: dict[int, threading.Barrier] = {}


@queue.handler("rendezvous", transactional=True)
def rendezvous(payload: dict[str, Any]) -> None:
    """Waits until ``parties`` transactional handlers hold their transactions at the same time."""
    with _lock:
        barrier = _barriers.setdefault(payload["parties"], threading.Barrier(payload["parties"], timeout=10))
    barrier.wait()


@queue.handler("once_slow", transactional=True)
def once_slow(payload: dict[str, Any]) -> None:
    """Exactly-once with its write already sent to the database, then a pause to crash in.

    Marks its start by creating ``payload["marker"]`` (a file, not a row: on
    SQLite the handler's transaction holds the write lock while it runs).
    """
    job = current_job()
    assert job.session is not None
    job.session.add(Once(job_id=job.id))
    job.session.flush()
    with open(f"{payload['marker']}.{job.attempt}", "w"):
        pass
    time.sleep(payload.get("sleep", 0))


@queue.handler("relay")
def relay(payload: dict[str, Any]) -> None:
    """Like ``record``, sleeping ``first`` seconds on attempt 1 and ``later`` on the others."""
    record("start")
    time.sleep(payload["first"] if current_job().attempt == 1 else payload["later"])
    record("finish")


@queue.handler("other_db_down")
def other_db_down(payload: dict[str, Any]) -> None:
    """Fails to reach a database that is not the queue's: the handler's own failure, charged."""
    other = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/elsewhere", connect_args={"connect_timeout": 2})
    try:
        with other.connect():
            pass
    finally:
        other.dispose()


@queue.handler("kill_own_backend", transactional=True)
def kill_own_backend(payload: dict[str, Any]) -> None:
    """Ends its own session's server process: to the worker, the queue database dropped under it."""
    from sqlalchemy import text  # here, so the shared import block above stays as it is

    session = current_job().session
    assert session is not None
    session.execute(text("select pg_terminate_backend(pg_backend_pid())"))


# -- results, progress and cancelling a running job (docs/howto/results.md, cancelling.md) -----------------


@queue.handler("result_value")
def answer(payload: dict[str, Any]) -> Any:
    """Returns ``payload["value"]`` (None when absent), after setting each of ``payload["progress"]``."""
    for step in payload.get("progress", []):
        current_job().set_progress(step)
    return payload.get("value")


#: Set by a test to let a running ``gate`` job end (in-process workers only).
GATE = threading.Event()


@queue.handler("gate")
def gate(payload: dict[str, Any]) -> None:
    """Runs until the test opens ``GATE`` (at most ``payload["seconds"]``, default 10)."""
    GATE.wait(payload.get("seconds", 10))


@queue.handler("join")
def join(payload: dict[str, Any]) -> Any:
    """A job graph's join: records its start, returns what its upstreams returned (sqla_jobs._graph)."""
    record("start")
    results = current_job().upstream_results()
    record("finish")
    return {"upstreams": results}


@queue.handler("join_async")
async def async_join(payload: dict[str, Any]) -> Any:
    await arecord("start")
    results = await current_job().upstream_results_async()
    await arecord("finish")
    return {"upstreams": results}


@queue.handler("batch_report")
def batch_report(payload: dict[str, Any]) -> Any:
    """A batch's callback: records its start, returns how the batch's members stood (sqla_jobs._batch)."""
    record("start")
    batch = current_job().batch()
    assert batch is not None
    return {"total": batch.total, "finished": batch.finished, "dead": batch.dead, "cancelled": batch.cancelled,
            "waiting": batch.waiting}


@queue.handler("batch_report_async")
async def batch_report_async(payload: dict[str, Any]) -> Any:
    await arecord("start")
    batch = await current_job().batch_async()
    assert batch is not None
    return {"total": batch.total, "finished": batch.finished, "dead": batch.dead, "cancelled": batch.cancelled,
            "waiting": batch.waiting}


@queue.handler("grow")
def grow(payload: dict[str, Any]) -> None:
    """A batch member that adds ``payload["more"]`` members to its own batch while it runs (keeping it open)."""
    record("start")
    batch = current_job().batch()
    assert batch is not None
    with Session(engine()) as session, session.begin():
        session.add_all(Job(kind="record", payload={}, batch=batch.id) for _ in range(payload.get("more", 0)))


@queue.handler("result_async")
async def answer_async(payload: dict[str, Any]) -> Any:
    return {"async": payload.get("value")}


@queue.handler("result_tx", transactional=True)
def answer_tx(payload: dict[str, Any]) -> Any:
    job = current_job()
    assert job.session is not None
    job.session.add(Once(job_id=job.id))
    return {"committed_with": job.id}


@queue.handler("result_tx_bad", transactional=True)
def answer_tx_bad(payload: dict[str, Any]) -> Any:
    job = current_job()
    assert job.session is not None
    job.session.add(Once(job_id=job.id))
    return {1, 2}


@queue.handler("result_bad")
def bad_result(payload: dict[str, Any]) -> Any:
    return {"when": datetime(2026, 1, 1)}


@queue.handler("progress")
def progress(payload: dict[str, Any]) -> Any:
    """Sets progress 1 of 2, waits for ``payload["marker"]`` (a file) to exist, sets 2 of 2, returns."""
    current_job().set_progress({"done": 1, "total": 2})
    deadline = time.monotonic() + 60
    while not os.path.exists(payload["marker"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    current_job().set_progress({"done": 2, "total": 2})
    return "all done"


@queue.handler("cooperative")
def cooperative(payload: dict[str, Any]) -> Any:
    """Waits (at most 60 s) for the cancel request to reach it, then stops as ``payload["mode"]`` says:
    ``return`` (a value), ``raise`` (``check_cancelled()``), ``error`` (any exception), or ``ignore``
    (never looks: sleeps ``payload["seconds"]`` and returns)."""
    record("start")
    job = current_job()
    mode = payload["mode"]
    if mode == "ignore":
        time.sleep(payload["seconds"])
        record("finish")
        return "ignored the request"
    job.cancelled.wait(60)
    record("cancelled" if job.cancel_requested else "gave up")
    if mode == "raise":
        job.check_cancelled()
    if mode == "error":
        raise RuntimeError("stopping because of the request")
    return "stopped early"


@queue.handler("cooperative_async")
async def cooperative_async(payload: dict[str, Any]) -> Any:
    """Sleeps 60 s unless cancelled: the request arrives as asyncio.CancelledError."""
    import asyncio  # here, so the shared import block above stays as it is

    record("start")
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        record("cancelled")
        raise
    return "slept"


@queue.handler("cooperative_tx", transactional=True)
def cooperative_tx(payload: dict[str, Any]) -> Any:
    """A transactional handler that writes, then returns once the cancel request reached it."""
    job = current_job()
    assert job.session is not None
    job.session.add(Once(job_id=job.id))
    job.cancelled.wait(60)
    return "wrote, then saw the request"


def _span_line(path: str, *fields: Any) -> None:
    # One short O_APPEND write per line: lines from several processes never interleave.
    with open(path, "a") as spans:
        spans.write(" ".join(map(str, fields)) + "\n")


@queue.handler("span")
def span(payload: dict[str, Any]) -> None:
    """Logs its start and its end (wall clock) to ``payload["spans"]``, runs ``sleep`` seconds or until
    cancelled: tests/reliability/test_matrix.py replays the lines to find runs of one job that overlapped."""
    job = current_job()
    _span_line(payload["spans"], "start", job.id, job.attempt, os.getpid(), time.time())
    job.cancelled.wait(payload["sleep"])
    _span_line(payload["spans"], "end", job.id, job.attempt, os.getpid(), time.time(), int(job.cancelled.is_set()))


@queue.handler("async_span")
async def async_span(payload: dict[str, Any]) -> None:
    """``span`` for the async worker: a cancel arrives as ``CancelledError``, and the end is logged anyway."""
    job = current_job()
    _span_line(payload["spans"], "start", job.id, job.attempt, os.getpid(), time.time())
    cancelled = 1
    try:
        await asyncio.sleep(payload["sleep"])
        cancelled = 0
    finally:
        _span_line(payload["spans"], "end", job.id, job.attempt, os.getpid(), time.time(), cancelled)


@queue.handler("poison_span")
def poison_span(payload: dict[str, Any]) -> None:
    """``span``'s poison: logs its start, gives the process's other runs ``after`` seconds to start, logs its
    process's death and ends the process (``os._exit``), every other run of the process with it: the matrix
    reads the death to know when those runs stopped."""
    job = current_job()
    _span_line(payload["spans"], "start", job.id, job.attempt, os.getpid(), time.time())
    time.sleep(payload.get("after", 0))
    _span_line(payload["spans"], "died", job.id, job.attempt, os.getpid(), time.time())
    os._exit(1)


@queue.handler("async_poison_span")
async def async_poison_span(payload: dict[str, Any]) -> None:
    """``poison_span`` for the async worker."""
    job = current_job()
    _span_line(payload["spans"], "start", job.id, job.attempt, os.getpid(), time.time())
    await asyncio.sleep(payload.get("after", 0))
    _span_line(payload["spans"], "died", job.id, job.attempt, os.getpid(), time.time())
    os._exit(1)


@queue.handler("seq")
def seq(payload: dict[str, Any]) -> None:
    """A job of a sequence (tests/test_sequences.py): logs its run's wall-clock start and end with its key and
    place; fails while the file ``fail_while`` exists (a job to dead-letter, then requeue), and its first
    ``fail_attempts`` attempts (a job that retries)."""
    started = time.time()
    if payload.get("sleep"):
        time.sleep(payload["sleep"])
    if payload.get("fail_while") and os.path.exists(payload["fail_while"]):
        raise RuntimeError("told to fail")
    if current_job().attempt <= payload.get("fail_attempts", 0):
        raise RuntimeError(f"attempt {current_job().attempt} told to fail")
    log_run(payload["log"], started, payload["key"], str(payload["n"]))
