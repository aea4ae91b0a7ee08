"""A handler's return value stored with its finished job, ``queue.result``, progress while it runs."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from sqla_jobs import JobStateError, NotFound, Worker
from tests.app import Once, queue
from tests.conftest import Database, run_cli
from tests.test_operations import APP, burst, enqueue, job_row


def result(db: Database, job_id: int) -> Any:
    with Session(db.engine) as session:
        return queue.result(session, job_id)


def test_a_returned_value_is_stored_and_read_back(db: Database) -> None:
    value = {"total": 3, "items": ["a", "é", None], "ok": True, "ratio": 0.5}
    answered = enqueue(db, "result_value", payload={"value": value, "progress": [{"done": 1}, {"done": 2}]})
    nothing = enqueue(db, "result_value")
    scalar = enqueue(db, "result_value", payload={"value": 7})
    asynchronous = enqueue(db, "result_async", payload={"value": "x"})
    transactional = enqueue(db, "result_tx")
    burst(db, concurrency=4)
    assert result(db, answered) == value
    assert job_row(db, answered).progress == {"done": 2}  # the last value set, written with the finish
    assert result(db, nothing) is None and job_row(db, nothing).progress is None
    assert result(db, scalar) == 7
    assert result(db, asynchronous) == {"async": "x"}
    assert result(db, transactional) == {"committed_with": transactional}
    for job_id in (answered, nothing, scalar, asynchronous, transactional):
        assert job_row(db, job_id).state == "finished"
    with Session(db.engine) as session:
        assert session.scalar(select(func.count()).select_from(Once).where(Once.job_id == transactional)) == 1


def test_result_errors_say_why(db: Database) -> None:
    pending = enqueue(db, "result_value")
    with Session(db.engine) as session:
        with pytest.raises(JobStateError, match=f"job {pending} is pending: it has no result yet"):
            queue.result(session, pending)
        with pytest.raises(NotFound, match="no job with id 987654"):
            queue.result(session, 987654)
    with Session(db.engine) as session, session.begin():
        queue.cancel(session, pending)
    with Session(db.engine) as session, pytest.raises(JobStateError, match="was cancelled: it has no result"):
        queue.result(session, pending)


def test_a_value_json_cannot_store_fails_the_run_with_a_clear_error(db: Database) -> None:
    job_id = enqueue(db, "result_bad", max_attempts=1)
    burst(db)
    assert job_row(db, job_id) is None  # an ordinary failure: on its last attempt, a dead letter
    with Session(db.engine) as session:
        dead = queue.get_dead(session, job_id)
    assert dead.last_error.startswith("InvalidResult: the handler's return value['when'] is a datetime")
    assert "isoformat" in dead.last_error
    # A transactional handler's bad value fails the same way, and its writes roll back.
    tx = enqueue(db, "result_tx_bad", max_attempts=1)
    burst(db)
    with Session(db.engine) as session:
        assert queue.get_dead(session, tx).last_error.startswith("InvalidResult: the handler's return value is a set")
        assert session.scalar(select(func.count()).select_from(Once).where(Once.job_id == tx)) == 0


def test_a_result_over_the_limit_is_refused(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(queue.job_model, "max_result_bytes", 64)
    job_id = enqueue(db, "result_value", payload={"value": "x" * 100}, max_attempts=1)
    burst(db)
    with Session(db.engine) as session:
        dead = queue.get_dead(session, job_id)
    assert "over the 64-byte limit" in dead.last_error


def test_progress_is_visible_while_the_job_runs(db: Database, tmp_path: Path) -> None:
    marker = tmp_path / "go"
    job_id = enqueue(db, "progress", payload={"marker": str(marker)})
    worker = Worker(db.engine, queue, concurrency=2, poll_interval=0.05)
    thread = threading.Thread(target=worker.run, kwargs={"burst": True, "install_signals": False})
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while job_row(db, job_id).progress != {"done": 1, "total": 2}:
            assert time.monotonic() < deadline, "progress never appeared"
            time.sleep(0.05)
        assert job_row(db, job_id).state == "running"
        shown = run_cli("jobs", "show", str(job_id), *APP, env=db.env())
        assert shown.returncode == 0, shown.stderr
        assert '"done": 1' in shown.stdout and "progress" in shown.stdout
        listed = run_cli("jobs", "list", "--state", "running", *APP, env=db.env(COLUMNS="200"))
        assert listed.returncode == 0, listed.stderr
        assert "progress" in listed.stdout and '{"done":1,"total":2}' in listed.stdout, listed.stdout
    finally:
        marker.touch()
        thread.join(60)
    row = job_row(db, job_id)
    assert (row.state, row.result, row.progress) == ("finished", "all done", {"done": 2, "total": 2})


def test_jobs_show_prints_the_result(db: Database) -> None:
    job_id = enqueue(db, "result_value", payload={"value": {"rows": 12}})
    burst(db)
    shown = run_cli("jobs", "show", str(job_id), *APP, env=db.env())
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert any(line.split() == ["result", "{"] for line in lines), shown.stdout
    assert '"rows": 12' in shown.stdout
    as_json = run_cli("jobs", "show", str(job_id), "--json", *APP, env=db.env())
    assert json.loads(as_json.stdout)["result"] == {"rows": 12}


def test_progress_values_are_checked() -> None:
    from sqla_jobs import InvalidJob, JobContext

    ctx = JobContext(1, "k", "default", 1, 1, {}, "w")
    ctx.set_progress({"done": 1})
    assert ctx.progress == {"done": 1}
    with pytest.raises(InvalidJob, match=r"the progress value\['at'\] is a set"):
        ctx.set_progress({"at": {1}})
    with pytest.raises(InvalidJob, match="over the 4096-byte limit"):
        ctx.set_progress("x" * 5000)
    with pytest.raises(ValueError, match="needs a value"):
        ctx.set_progress(None)
