"""The dashboard's charts over time (issues 30 and 31): the time axis spans the chosen window ending now
(an hour for "last hour", even with one sample), not years around a single sample, nor a minute; a period
without samples is a gap, not a straight line."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import func, select, update

from sqla_jobs.web import dashboard, record_sample, samples_table
from tests import app
from tests.conftest import Database
from tests.dashboard_helpers import client
from tests.helpers import enqueue


def sample_at(db: Database, minutes_ago: float) -> None:
    """Write one sample of the figures now, dated ``minutes_ago``."""
    table = samples_table(app.queue)
    table.create(db.engine, checkfirst=True)
    with db.engine.connect() as conn:
        before = conn.scalar(select(func.max(table.c.id)))
    record_sample(db.engine, app.queue)
    taken = datetime.now(timezone.utc) - timedelta(minutes=minutes_ago)
    with db.engine.begin() as conn:
        conn.execute(update(table).where(table.c.id > (before or 0)).values(taken_at=taken))


def test_one_sample_gives_the_whole_window(db: Database) -> None:
    enqueue(db.engine, "record")
    sample_at(db, 10)
    data = client(db, sample_interval=3600).get("/api/series", params={"span": "hour"}).json()
    now = time.time()
    [at] = data["times"]
    assert abs(at - (now - 600)) < 30  # drawn where it was taken ...
    assert abs(data["from"] - (now - 3600)) < 30 and abs(data["to"] - now) < 30  # ... in the last hour
    assert data["series"]["ready"] == {"default": [1.0]}


def test_a_fresh_sample_and_an_old_history_get_the_window(db: Database) -> None:
    enqueue(db.engine, "record")
    data = client(db).get("/api/series", params={"span": "hour"}).json()  # the page writes one sample now
    assert len(data["times"]) == 1 and data["to"] - data["from"] == 3600
    sample_at(db, 300)  # five hours ago: outside the hour, inside the day
    day = client(db, sample_interval=3600).get("/api/series", params={"span": "day"}).json()
    assert day["to"] - day["from"] == 86400 and len(day["times"]) >= 2


def test_a_period_without_samples_is_a_gap(db: Database) -> None:
    enqueue(db.engine, "record")
    for minutes in (50, 49, 48, 10, 9):
        sample_at(db, minutes)
    web = client(db, sample_interval=60, record_samples=False)  # only the samples above
    data = web.get("/api/series", params={"span": "hour"}).json()
    ready = data["series"]["ready"]["default"]
    assert ready == [1.0, 1.0, 1.0, None, 1.0, 1.0], ready  # one None between 48 and 10 minutes ago
    gap = data["times"][3]
    assert data["times"][2] < gap < data["times"][4]
    assert data["times"] == sorted(data["times"])


@pytest.fixture
def chart_page(db: Database) -> Iterator[tuple[Any, str]]:
    from tests.browser import new_browser, require_browser, serve

    require_browser()
    browser = new_browser()
    try:
        with serve(dashboard(db.engine, app.queue, refresh=1.0, sample_interval=60, record_samples=False)) as url:
            yield browser, url
    finally:
        browser.quit()


def test_the_chart_draws_the_axis_and_the_gap_in_a_browser(db: Database, chart_page: tuple[Any, str]) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    browser, url = chart_page
    enqueue(db.engine, "record")
    for minutes in (50, 49, 48, 10):
        sample_at(db, minutes)
    browser.get(url + "/")
    script = ("var p = (document.getElementById('charts').plots || {}).ready;"
              "return p ? [p.scales.x.min, p.scales.x.max, p.data[1]] : null;")
    x_min, x_max, values = WebDriverWait(browser, 20).until(lambda b: b.execute_script(script))
    now = time.time()
    assert abs(x_min - (now - 3600)) < 120, (x_min, now)  # the last hour ...
    assert abs(x_max - now) < 120, (x_max, now)  # ... ending now: not 2027 to 2029
    assert None in values, values  # the 38 minutes without samples are a gap
