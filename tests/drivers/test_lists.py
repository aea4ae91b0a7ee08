"""The dashboard's lists (``drivers/_dashboard.py``'s ``job_page``) hold exactly the jobs their filters pick.

A list of a queue or a kind is put together from several pages, one for each (queue, kind) pair along
``ix_<jobs>_by_queue_kind``, after a skip scan of the other column's values, plus the running jobs through their
own index. Whatever the mix of queues, kinds and states, paging through such a list newest first must give each
matching job once, in order, and no other.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import insert

from sqla_jobs.drivers._dashboard import job_page
from tests.drivers.conftest import Backend

QUEUES = ("default", "mail", "reports")
KINDS = ("a", "b", "c", "d")
STATES = ("pending", "running", "blocked", "finished", "cancelled")
JOB = st.tuples(st.sampled_from(QUEUES), st.sampled_from(KINDS), st.sampled_from(STATES))
# No `pending`: a pending list is in claim order along the claim index (tests/test_dashboard.py pages it).
FILTERS = st.tuples(st.sampled_from((None, *QUEUES)), st.sampled_from((None, *KINDS)),
                    st.sampled_from((None, "blocked", "finished", "cancelled", "running")))


def fill(backend: Backend, jobs: list[tuple[str, str, str]]) -> list[int]:
    t = backend.driver.jobs
    ids = []
    with backend.write() as conn:
        conn.execute(t.delete())
        for queue, kind, state in jobs:
            row: dict[str, Any] = {"kind": kind, "queue": queue, "payload": {}, "state": state}
            if state == "blocked":
                row["waiting_for"] = 1
            ids.append(conn.execute(insert(t).values(**row)).inserted_primary_key[0])
    return ids


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(JOB, max_size=40), st.lists(FILTERS, min_size=1, max_size=4), st.integers(1, 7))
def test_a_list_pages_through_exactly_the_jobs_its_filters_pick(
        backend: Backend, jobs: list[tuple[str, str, str]], filters: list[tuple[str | None, str | None, str | None]],
        limit: int) -> None:
    ids = fill(backend, jobs)
    for queue, kind, state in filters:
        expected = [i for i, (q, k, s) in zip(ids, jobs, strict=True)
                    if queue in (None, q) and kind in (None, k) and state in (None, s)][::-1]
        seen: list[int] = []
        before: int | None = None
        with backend.db.engine.connect() as conn:
            while True:
                page = job_page(backend.driver, conn, queue=queue, kind=kind, state=state, before_id=before,
                                limit=limit)
                assert len(page) <= limit
                seen += [row.id for row in page]
                if len(page) < limit:
                    break
                before = page[-1].id
        assert seen == expected, (queue, kind, state)
