"""Every list the dashboard links to reads about a page of rows, wherever the matching rows sit (issue 31).

The table is the adversarial one: the pending jobs are the *oldest* rows (a
worker down for a week), then tens of thousands of finished ones, analysed.
A list that walks the primary key and filters ("Rows Removed by Filter" in the
tens of thousands) was the bug; a timer on a loaded 2-core machine would not
tell it from noise, the plan does. Each URL is requested through the real app,
its statements captured as the database receives them (``before_cursor_execute``),
and each is run again under ``EXPLAIN ANALYZE``: the rows its scans read are
counted from the plan.

PostgreSQL only, where the planner's choice depends on the statistics, which is what
could go wrong: SQLite's EXPLAIN QUERY PLAN reports the index chosen but no row
counts, and tests/test_dashboard.py already runs every list on SQLite and MariaDB for
its results.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event, text

from tests.conftest import Database
from tests.dashboard_helpers import client

PAGE = 51  # the page size plus the row that tells there is a next page
PENDING, RUNNING, FINISHED = 2_000, 20, 40_000

# The pending jobs, created and due a week ago, oldest ids; a quarter in queue `mail`, kinds in thirds.
FILL = f"""
INSERT INTO jobs (kind, queue, payload, priority, state, run_at, created_at, attempts, max_attempts, unique_key)
SELECT 'kind_' || (i % 3), CASE WHEN i % 4 = 0 THEN 'mail' ELSE 'default' END, '{{}}',
       CASE WHEN i % 5 = 0 THEN 1 ELSE 0 END, 'pending',
       now() - interval '7 days' + make_interval(secs => i), now() - interval '7 days' + make_interval(secs => i),
       0, 5, CASE WHEN i % 100 = 0 THEN 'order-' || (i / 100) END
FROM generate_series(1, {PENDING}) AS i;
INSERT INTO jobs (kind, queue, payload, priority, state, run_at, created_at, attempts, max_attempts, locked_at,
                  locked_by, claim_token, lease_expires_at)
SELECT 'kind_' || (i % 3), 'default', '{{}}', 0, 'running', now(), now(), 1, 5, now(), 'test', md5(i::text),
       now() + interval '60 seconds'
FROM generate_series(1, {RUNNING}) AS i;
INSERT INTO jobs (kind, queue, payload, priority, state, run_at, created_at, attempts, max_attempts, locked_at,
                  finished_at, unique_key)
SELECT 'kind_' || (i % 3), CASE WHEN i % 4 = 0 THEN 'mail' ELSE 'default' END, '{{}}', 0, 'finished',
       t, t, 1, 5, t, t + interval '1 second', CASE WHEN i % 1000 = 0 THEN 'order-' || (i / 1000) END
FROM (SELECT i, now() - make_interval(secs => ({FINISHED} - i) * 6) AS t
      FROM generate_series(1, {FINISHED}) AS i) AS s;
"""

#: Every list the dashboard links to: the state choices, the overview's per-queue and per-kind links
#: (with state=pending), the filter form's fields and their combinations.
LISTS = [
    "/jobs", "/jobs?state=pending", "/jobs?state=running", "/jobs?state=finished",
    "/jobs?queue=mail&state=pending", "/jobs?kind=kind_1&state=pending", "/jobs?kind=kind_1&queue=mail&state=pending",
    "/jobs?queue=mail", "/jobs?kind=kind_1", "/jobs?state=finished&kind=kind_1&queue=mail",
    "/jobs?unique_key=order-7", "/jobs?unique_key=order-7&state=pending",
]
#: The rarest filter among the rows an index hands over matches 1 row in 12 (queue mail and kind_1):
#: a page of them is 12 pages of rows read.
BOUND = 13 * PAGE
#: Lists with `since` (created within), with the jobs that ended in that window (one every 6 s in this table).
#: Their ended jobs are read by `finished_at` (an ended job finished after it was created): bounded by the
#: jobs that ended in the window. An index of the pending jobs by creation time would cost every enqueue, so
#: the pending and running ones are read whole (without state, or with theirs): bounded by the live jobs.
SINCE_LISTS = [
    ("/jobs?since=1h&state=finished", 600), ("/jobs?since=1h&state=finished&kind=kind_1", 600),
    ("/jobs?since=10m&queue=mail", PENDING + RUNNING + 100), ("/jobs?since=1h", PENDING + RUNNING + 600),
    ("/jobs?since=1h&kind=kind_1", PENDING + RUNNING + 600), ("/jobs?since=2h&state=pending", PENDING),
]


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Database]:
    from tests import app
    from tests.conftest import make_database

    for db in make_database("postgresql", tmp_path_factory.mktemp("plans")):
        app.Base.metadata.create_all(db.engine)
        with db.engine.begin() as conn:
            conn.execute(text(FILL))
        with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE jobs"))
        yield db


def statements(db: Database, url: str) -> list[tuple[str, Any]]:
    """The SELECTs on the jobs table the dashboard sends to render ``url``, with their parameters."""
    seen: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if statement.lstrip().upper().startswith("SELECT") and re.search(r"\bFROM jobs\b", statement):
            seen.append((statement, parameters))

    event.listen(db.engine, "before_cursor_execute", capture)
    try:
        response = client(db, record_samples=False).get(url)
    finally:
        event.remove(db.engine, "before_cursor_execute", capture)
    assert response.status_code == 200, (url, response.text[:500])
    assert seen, f"{url} sent no SELECT on jobs"
    return seen


def scans(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of ``plan`` that reads the jobs table."""
    if plan.get("Relation Name") == "jobs":
        yield plan
    for child in plan.get("Plans", []):
        yield from scans(child)


def rows_read(db: Database, statement: str, parameters: Any) -> tuple[int, list[str]]:
    """Rows the statement's scans of jobs returned or filtered out, by EXPLAIN ANALYZE; and the scan types."""
    with db.engine.connect() as conn:
        plan = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}", parameters).scalar()
    nodes = list(scans(plan[0]["Plan"]))
    read = sum((n["Actual Rows"] + n.get("Rows Removed by Filter", 0) + n.get("Rows Removed by Index Recheck", 0))
               * n["Actual Loops"] for n in nodes)
    return read, [f'{n["Node Type"]} {n.get("Index Name", "")}'.strip() for n in nodes]


def next_page(db: Database, url: str) -> str:
    html = client(db, record_samples=False).get(url).text
    found = re.search(r'id="next" href="http://testserver([^"]+)"', html)
    assert found, f"{url}: the test's table should give it a second page"
    return found.group(1).replace("&amp;", "&")


@pytest.mark.parametrize("url", LISTS)
def test_a_list_reads_about_a_page_of_rows(table: Database, url: str) -> None:
    for statement, parameters in statements(table, url):
        read, nodes = rows_read(table, statement, parameters)
        assert not any(n.startswith("Seq Scan") for n in nodes), (url, nodes)
        assert read <= BOUND, f"{url} read {read} rows of jobs for a page ({nodes})"


@pytest.mark.parametrize("url", ["/jobs?state=pending", "/jobs?queue=mail&state=pending", "/jobs?kind=kind_1"])
def test_a_deep_page_costs_what_the_first_costs(table: Database, url: str) -> None:
    for _ in range(6):  # past the first priority of the pending jobs: the cursor crosses into the next
        url = next_page(table, url)
    for statement, parameters in statements(table, url):
        read, nodes = rows_read(table, statement, parameters)
        assert read <= BOUND, f"{url} read {read} rows of jobs for a page ({nodes})"


@pytest.mark.parametrize(("url", "in_window"), SINCE_LISTS)
def test_a_list_since_a_time_reads_the_window_and_the_live_jobs_at_most(
    table: Database, url: str, in_window: int
) -> None:
    for statement, parameters in statements(table, url):
        read, nodes = rows_read(table, statement, parameters)
        assert not any(n.startswith("Seq Scan") for n in nodes), (url, nodes)
        assert read <= in_window + 2 * PAGE, f"{url} read {read} rows of jobs ({nodes})"
