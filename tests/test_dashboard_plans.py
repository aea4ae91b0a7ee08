"""Every list the dashboard links to reads about a page of rows, wherever the matching rows sit (issue 31).

The table is the adversarial one: the pending jobs are the *oldest* rows (a
worker down for a week), then tens of thousands of finished ones, analysed.
A list that walks the primary key and filters ("Rows Removed by Filter" in the
tens of thousands) was the bug; a timer on a loaded 2-core machine would not
tell it from noise, the plan does. Each URL is requested through the real app,
its statements captured as the database receives them (``before_cursor_execute``),
and each is run again under the database's own ANALYZE: the rows its scans read
are counted from the plan.

On PostgreSQL (EXPLAIN ANALYZE) and MariaDB (ANALYZE FORMAT=JSON, its ``r_rows``),
whose planners choose by statistics and a LIMIT, which is what could go wrong.
Not on SQLite: its EXPLAIN QUERY PLAN names the index but counts no rows, and
tests/test_dashboard.py runs every list there for its results.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import event, text

from tests import app
from tests.conftest import Database, make_database
from tests.dashboard_helpers import client

PAGE = 51  # the page size plus the row that tells there is a next page
PENDING, BLOCKED, RUNNING, FINISHED = 2_000, 30, 20, 40_000


def rows() -> list[dict[str, Any]]:
    """The table: pending jobs created and due a week ago (the oldest ids; a quarter in queue `mail`, kinds in
    thirds, a fifth at priority 1), a few blocked ones as old (waiting for jobs they depend on), a few running, then
    ended jobs, one every 6 s up to now (1 in 2,000 cancelled: a page of them is spread over the whole table).
    Queue `reports`, all its jobs of kind `report`, is rare: 50 pending jobs among the oldest, 5 ended ones."""
    now = datetime.now(timezone.utc)
    week_ago = now - timedelta(days=7)
    out: list[dict[str, Any]] = []
    for i in range(1, PENDING + 1):
        at = week_ago + timedelta(seconds=i)
        rare = i % 40 == 7
        out.append({"kind": "report" if rare else f"kind_{i % 3}",
                    "queue": "reports" if rare else "mail" if i % 4 == 0 else "default", "payload": {},
                    "priority": 1 if i % 5 == 0 else 0, "state": "pending", "run_at": at, "created_at": at,
                    "unique_key": f"order-{i // 100}" if i % 100 == 0 else None})
    for i in range(1, BLOCKED + 1):
        at = week_ago + timedelta(seconds=PENDING + i)
        out.append({"kind": f"kind_{i % 3}", "queue": "default", "payload": {}, "priority": 0, "state": "blocked",
                    "waiting_for": 1, "run_at": at, "created_at": at})
    for i in range(1, RUNNING + 1):
        out.append({"kind": f"kind_{i % 3}", "queue": "default", "payload": {}, "priority": 0, "state": "running",
                    "run_at": now, "created_at": now, "attempts": 1, "locked_at": now, "locked_by": "test",
                    "claim_token": f"token-{i}", "lease_expires_at": now + timedelta(minutes=1)})
    for i in range(1, FINISHED + 1):
        at = now - timedelta(seconds=(FINISHED - i) * 6)
        rare = i % 8000 == 3
        out.append({"kind": "report" if rare else f"kind_{i % 3}",
                    "queue": "reports" if rare else "mail" if i % 4 == 0 else "default", "payload": {},
                    "priority": 0, "state": "cancelled" if i % 2000 == 1 or i == 16003 else "finished", "run_at": at,
                    "created_at": at, "attempts": 1,
                    "locked_at": at, "finished_at": at + timedelta(seconds=1),
                    "unique_key": f"order-{i // 1000}" if i % 1000 == 0 else None})
    return [{"attempts": 0, "waiting_for": 0, "locked_at": None, "locked_by": None, "claim_token": None,
             "lease_expires_at": None, "finished_at": None, "unique_key": None, **row} for row in out]


#: Every list the dashboard links to: the state choices, the overview's per-queue and per-kind links
#: (with state=pending), the filter form's fields and their combinations.
LISTS = [
    "/jobs", "/jobs?state=pending", "/jobs?state=running", "/jobs?state=finished", "/jobs?state=cancelled",
    "/jobs?state=blocked",
    "/jobs?queue=mail&state=pending", "/jobs?kind=kind_1&state=pending", "/jobs?kind=kind_1&queue=mail&state=pending",
    "/jobs?state=finished&kind=kind_1&queue=mail",
    "/jobs?unique_key=order-7", "/jobs?unique_key=order-7&state=pending",
    # A queue or a kind, without a state or in one, along ix_<jobs>_by_queue_kind (the running jobs through
    # their own index); before, a rare one (`reports`, `report`) walked the primary key past every ended job.
    "/jobs?queue=mail", "/jobs?kind=kind_1", "/jobs?queue=reports", "/jobs?kind=report",
    "/jobs?queue=reports&kind=report",
    "/jobs?queue=reports&state=finished", "/jobs?kind=report&state=finished", "/jobs?kind=report&state=cancelled",
    "/jobs?queue=reports&state=blocked",
]
#: The rarest filter among the rows an index hands over matches 1 row in 12 (queue mail and kind_1):
#: a page of them is 12 pages of rows read.
BOUND = 13 * PAGE
#: Lists with `since` (created within), with the jobs that ended in that window (one every 6 s in this table).
#: Their ended jobs are read by `finished_at` (an ended job finished after it was created): bounded by the
#: jobs that ended in the window. An index of the pending jobs by creation time would cost every enqueue, so
#: the pending, running and blocked ones are read whole (without state, or with theirs): bounded by the live jobs.
SINCE_LISTS = [
    ("/jobs?since=1h&state=finished", 600), ("/jobs?since=1h&state=finished&kind=kind_1", 600),
    ("/jobs?since=10m&queue=mail", PENDING + BLOCKED + RUNNING + 100),
    ("/jobs?since=1h", PENDING + BLOCKED + RUNNING + 600),
    ("/jobs?since=1h&kind=kind_1", PENDING + BLOCKED + RUNNING + 600), ("/jobs?since=2h&state=pending", PENDING),
]


@pytest.fixture(scope="module", params=["postgresql", "mariadb"])
def table(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Database]:
    for db in make_database(request.param, tmp_path_factory.mktemp("plans")):
        app.Base.metadata.create_all(db.engine)
        with db.engine.begin() as conn:
            conn.execute(app.Job.__table__.insert(), rows())
        with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE jobs" if db.backend == "postgresql" else "ANALYZE TABLE jobs"))
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


def scans(plan: Any) -> Iterator[dict[str, Any]]:
    """Every node of a plan that reads the jobs table (PostgreSQL's EXPLAIN or MariaDB's ANALYZE, as JSON)."""
    if isinstance(plan, dict):
        if plan.get("Relation Name") == "jobs" or plan.get("table_name") == "jobs":
            yield plan
        for value in plan.values():
            yield from scans(value)
    elif isinstance(plan, list):
        for value in plan:
            yield from scans(value)


def rows_read(db: Database, statement: str, parameters: Any) -> tuple[int, list[str]]:
    """Rows the statement's scans of jobs read (returned or filtered out), as the database ran it; and how."""
    with db.engine.connect() as conn:
        if db.backend == "postgresql":
            plan = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}", parameters).scalar()
            nodes = list(scans(plan))
            read = sum((n["Actual Rows"] + n.get("Rows Removed by Filter", 0)
                        + n.get("Rows Removed by Index Recheck", 0)) * n["Actual Loops"] for n in nodes)
            return read, [f'{n["Node Type"]} {n.get("Index Name", "")}'.strip() for n in nodes]
        # MariaDB: r_rows is the rows the engine handed over per loop, before the WHERE's filter.
        plan = json.loads(conn.exec_driver_sql(f"ANALYZE FORMAT=JSON {statement}", parameters).scalar())
        nodes = list(scans(plan))
        read = sum(round(float(n.get("r_rows", 0)) * float(n.get("r_loops", 1))) for n in nodes)
        return read, [f'{n["access_type"]} {n.get("key", "")}'.strip() for n in nodes]


def full_scan(node: str) -> bool:
    return node.startswith("Seq Scan") or node.startswith("ALL")


def next_page(db: Database, url: str) -> str:
    html = client(db, record_samples=False).get(url).text
    found = re.search(r'id="next" href="http://testserver([^"]+)"', html)
    assert found, f"{url}: the test's table should give it a second page"
    return found.group(1).replace("&amp;", "&")


@pytest.mark.parametrize("url", LISTS)
def test_a_list_reads_about_a_page_of_rows(table: Database, url: str) -> None:
    for statement, parameters in statements(table, url):
        read, nodes = rows_read(table, statement, parameters)
        assert not any(full_scan(n) for n in nodes), (url, nodes)
        assert read <= BOUND, f"{url} read {read} rows of jobs for a page ({nodes})"


@pytest.mark.parametrize("url", ["/jobs?state=pending", "/jobs?queue=mail&state=pending", "/jobs?kind=kind_1",
                                 "/jobs?queue=mail"])
def test_a_deep_page_costs_what_the_first_costs(table: Database, url: str) -> None:
    for _ in range(6):  # past the first priority of the pending jobs: the cursor crosses into the next
        url = next_page(table, url)
    for statement, parameters in statements(table, url):
        read, nodes = rows_read(table, statement, parameters)
        assert read <= BOUND, f"{url} read {read} rows of jobs for a page ({nodes})"


@pytest.mark.parametrize(("url", "in_window"), SINCE_LISTS)
def test_a_list_since_a_time_reads_the_window_and_the_live_jobs_at_most(table: Database, url: str,
                                                                        in_window: int) -> None:
    """On MariaDB the live states' branches are told to leave the primary key (``Driver.by_state``): under ORDER BY
    id DESC LIMIT it walked it from the newest row, past the million finished rows, to the few old pending jobs."""
    for statement, parameters in statements(table, url):
        read, nodes = rows_read(table, statement, parameters)
        assert not any(full_scan(n) for n in nodes), (url, nodes)
        assert read <= in_window + 2 * PAGE, f"{url} read {read} rows of jobs ({nodes})"

