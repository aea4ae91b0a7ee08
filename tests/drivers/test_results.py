"""Results, progress and cancel requests of running jobs (``drivers/_results.py``), fenced like every write."""

from __future__ import annotations

from sqlalchemy import func

from tests.drivers.conftest import Backend, in_write
from tests.drivers.test_writes import PAST


def test_set_results_stores_result_and_progress_under_the_fence_only(backend: Backend) -> None:
    backend.insert(3, run_at=PAST)
    a, b, c = backend.claim(3)
    rows = [
        (a.fence, {"answer": 42, "text": "é ☃"}, {"done": 3, "total": 3}),
        (b.fence, [1, 2.5, None, True], None),  # no progress: the column stays as it is
        ((c.id, "someone-else"), "not ours", 7),  # a lost claim: nothing is written
    ]
    in_write(backend, lambda conn: backend.driver.set_results(conn, rows))
    assert (backend.row(a.id).result, backend.row(a.id).progress) == ({"answer": 42, "text": "é ☃"},
                                                                       {"done": 3, "total": 3})
    assert (backend.row(b.id).result, backend.row(b.id).progress) == ([1, 2.5, None, True], None)
    assert (backend.row(c.id).result, backend.row(c.id).progress) == (None, None)
    # Once finished, the run is no longer running under its claim: a late write changes nothing.
    in_write(backend, lambda conn: backend.driver.finish(conn, [a.fence]))
    in_write(backend, lambda conn: backend.driver.set_results(conn, [(a.fence, "late", "late")]))
    assert backend.row(a.id).result == {"answer": 42, "text": "é ☃"}
    in_write(backend, lambda conn: backend.driver.set_results(conn, []))  # nothing to do is fine


def test_set_progress_keeps_the_latest_value_of_running_jobs(backend: Backend) -> None:
    backend.insert(2, run_at=PAST)
    a, b = backend.claim(2)
    in_write(backend, lambda conn: backend.driver.set_progress(conn, [(a.fence, 0.25), (b.fence, "step 1")]))
    in_write(backend, lambda conn: backend.driver.set_progress(conn, [(a.fence, 0.5), ((b.id, "lost"), "x")]))
    assert (backend.row(a.id).progress, backend.row(b.id).progress) == (0.5, "step 1")
    assert backend.row(a.id).result is None and backend.row(a.id).state == "running"


def test_cancel_requests_names_only_requested_runs_still_ours(backend: Backend) -> None:
    backend.insert(3, run_at=PAST)
    a, b, c = backend.claim(3)
    assert in_write(backend, lambda conn: backend.driver.cancel_requests(conn, [a.fence, b.fence])) == set()
    for job in (a, c):
        assert in_write(backend, lambda conn, job=job: backend.driver.cancel(conn, job.id)) == (True, "running")
    asked = [a.fence, b.fence, (c.id, "someone-else")]
    assert in_write(backend, lambda conn: backend.driver.cancel_requests(conn, asked)) == {a.fence}
    assert in_write(backend, lambda conn: backend.driver.cancel_requests(conn, [])) == set()


def test_result_of_reads_state_and_result(backend: Backend) -> None:
    backend.insert(1, run_at=PAST)
    [job] = backend.claim(1)
    with backend.db.engine.connect() as conn:
        assert backend.driver.result_of(conn, job.id) == ("running", None)
        missing = backend.scalar(func.coalesce(func.max(backend.driver.jobs.c.id), 0)) + 1000
        assert backend.driver.result_of(conn, missing) is None
    in_write(backend, lambda conn: backend.driver.set_results(conn, [(job.fence, {"ok": True}, None)]))
    in_write(backend, lambda conn: backend.driver.finish(conn, [job.fence]))
    with backend.db.engine.connect() as conn:
        assert backend.driver.result_of(conn, job.id) == ("finished", {"ok": True})
