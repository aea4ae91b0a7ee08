"""Shared by the dashboard tests: a client on a real database, figures read back from the HTML, forms posted."""

from __future__ import annotations

import re
from html import unescape
from typing import Any

from starlette.testclient import TestClient

from sqla_jobs.web import dashboard
from tests import app
from tests.conftest import Database
from tests.helpers import count, enqueue, run_burst

TOKEN = "t0ken-for-the-dashboard-tests"


def client(db: Database, **options: Any) -> TestClient:
    return TestClient(dashboard(db.engine, app.queue, **options))


def figure(html: str, name: str) -> str:
    """The text of the overview's figure ``fig-<name>``."""
    match = re.search(rf'id="fig-{name}">([^<]*)<', html)
    assert match, f"no figure {name} in the page"
    return unescape(match.group(1))


def csrf(c: TestClient, page: str = "/") -> str:
    """Open a page (which sets the CSRF cookie) and return the token its forms carry."""
    html = c.get(page).text
    match = re.search(r'name="csrf" value="([^"]+)"', html)
    token = match.group(1) if match else c.cookies.get("sqla_jobs_csrf")
    assert token, "the page set no CSRF token"
    return token


def post(c: TestClient, action: str, *, confirmed: bool = True, headers: dict[str, str] | None = None,
         **fields: Any) -> Any:
    data: dict[str, Any] = {"csrf": csrf(c), **fields}
    if confirmed:
        data["confirmed"] = "1"
    return c.post(f"/actions/{action}", data=data, headers=headers or {}, follow_redirects=False)


def kill(db: Database, n: int = 1, kind: str = "fail", **payload: str) -> list[int]:
    """Enqueue ``n`` jobs that fail for good and run them into the dead-letter table."""
    ids = [enqueue(db.engine, kind, dict(payload), max_attempts=1) for _ in range(n)]
    run_burst(db.engine)
    assert count(db.engine, app.DeadJob, app.DeadJob.id.in_(ids)) == n
    return ids
