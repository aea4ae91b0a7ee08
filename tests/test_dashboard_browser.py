"""The dashboard in headless Chromium: what a person sees and clicks, against a real server and database."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException, TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from sqla_jobs.web import dashboard
from tests import app
from tests.browser import new_browser, require_browser, serve
from tests.conftest import Database
from tests.dashboard_helpers import TOKEN, kill
from tests.helpers import enqueue, job, mixed_graph, run_burst


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    require_browser()
    driver = new_browser()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def site(db: Database, browser: Any) -> Iterator[str]:
    browser.delete_all_cookies()
    with serve(dashboard(db.engine, app.queue, actions=True, token=TOKEN, refresh=1.0)) as url:
        yield url


def wait(browser: Any) -> WebDriverWait[Any]:
    """Wait up to 20 s; the page may be mid-reload or mid-htmx-swap, so a vanished element is retried."""
    return WebDriverWait(browser, 20, ignored_exceptions=(NoSuchElementException, StaleElementReferenceException))


def text_of(browser: Any, css: str) -> str:
    """The text of the element ``css`` once it exists, read in one go so a refresh cannot stale it."""
    return str(wait(browser).until(lambda b: [b.find_element(By.CSS_SELECTOR, css).text])[0])


def shows(browser: Any, css: str, expected: str) -> bool:
    """Whether the element ``css`` comes to contain ``expected`` within the wait (False otherwise)."""
    try:
        wait(browser).until(lambda b: expected in b.find_element(By.CSS_SELECTOR, css).text)
    except TimeoutException:
        return False
    return True


def click(browser: Any, by: str, value: str) -> None:
    """Click the element, finding it again if a refresh replaced it between finding and clicking."""
    wait(browser).until(lambda b: b.find_element(by, value).click() or True)


def test_overview_figures_match_queue_stats_and_charts_draw(db: Database, browser: Any, site: str) -> None:
    kill(db, n=2)
    for _ in range(4):
        enqueue(db.engine, "record")
    browser.get(site + "/")
    stats = app.queue.stats(db.engine)
    assert text_of(browser, "#fig-ready") == str(stats.ready) == "4"
    assert text_of(browser, "#fig-dead") == str(stats.dead_total) == "2"
    assert text_of(browser, "#fig-running") == str(stats.running)
    # The page wrote a sample; uPlot draws it on a canvas (so the vendored scripts load and run).
    wait(browser).until(lambda b: b.find_elements(By.CSS_SELECTOR, '.chart[data-series="ready"] canvas'))
    # The figures are live: a drained queue shows up without a reload (htmx refresh every second).
    run_burst(db.engine)
    assert shows(browser, "#fig-ready", "0")


def test_filter_jobs_and_open_one(db: Database, browser: Any, site: str) -> None:
    done = enqueue(db.engine, "record", {"note": "<script>document.title='owned'</script>"})
    run_burst(db.engine)
    waiting = enqueue(db.engine, "noop")
    browser.get(site + "/jobs")
    Select(browser.find_element(By.NAME, "state")).select_by_value("finished")
    click(browser, By.ID, "apply")
    wait(browser).until(lambda b: "state=finished" in b.current_url)
    links = "#jobs td:first-child a"
    shown = wait(browser).until(lambda b: [[a.text for a in b.find_elements(By.CSS_SELECTOR, links)]])[0]
    assert shown == [str(done)] and str(waiting) not in shown
    click(browser, By.LINK_TEXT, str(done))
    assert shows(browser, "#job-state", "finished")
    assert "<script>document.title='owned'</script>" in text_of(browser, "#payload")  # shown as text
    assert browser.title != "owned"  # and never run


def test_retry_a_dead_letter_after_logging_in(db: Database, browser: Any, site: str) -> None:
    [dead_id] = kill(db)
    browser.get(site + "/login")
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    click(browser, By.ID, "login")
    assert shows(browser, "header", "actions enabled")
    browser.get(site + "/dead")
    click(browser, By.LINK_TEXT, str(dead_id))
    click(browser, By.ID, "action-requeue")
    assert shows(browser, "#question", "back to the queue")
    click(browser, By.ID, "confirm")
    assert shows(browser, "#job-state", "pending")
    assert text_of(browser, "#flash") == f"Done: requeued 1 job(s): {dead_id}"  # says what it did
    row = job(db.engine, dead_id)
    assert row is not None and row.state == "pending"
    browser.refresh()  # said once: the next page has no stale confirmation
    assert shows(browser, "#job-state", "pending") and not browser.find_elements(By.ID, "flash")


def test_cancel_confirms_what_it_did(db: Database, browser: Any, site: str) -> None:
    job_id = enqueue(db.engine, "record", run_at=datetime.now(timezone.utc) + timedelta(hours=1))
    browser.get(site + "/login")
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    click(browser, By.ID, "login")
    assert shows(browser, "header", "actions enabled")  # logged in before the job page is asked for
    browser.get(site + f"/jobs/{job_id}")
    click(browser, By.ID, "action-cancel")
    click(browser, By.ID, "confirm")
    assert shows(browser, "#job-state", "cancelled")
    assert "cancelled (it will never run)" in text_of(browser, "#flash")


def test_one_sample_draws_the_last_hour(db: Database, browser: Any) -> None:
    # A fresh dashboard: the overview writes its first sample, the chart shows the hour ending now.
    enqueue(db.engine, "record")
    with serve(dashboard(db.engine, app.queue, refresh=1.0)) as url:
        browser.get(url + "/?span=hour")
        script = ("var p = (document.getElementById('charts').plots || {}).ready;"
                  "return p ? [p.scales.x.min, p.scales.x.max, p.data[0].length,"
                  "            p.series[0].value(p, p.data[0][0])] : null;")
        x_min, x_max, points, shown = wait(browser).until(lambda b: b.execute_script(script))
    now = time.time()
    assert points == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", shown), shown  # the pages' one format
    assert abs(x_max - now) < 120 and abs(x_max - x_min - 3600) < 5, (x_min, x_max, now)  # not 2027 to 2029


def test_an_action_is_refused_without_the_credential(db: Database, browser: Any, site: str) -> None:
    [dead_id] = kill(db)
    browser.get(site + f"/jobs/{dead_id}")
    assert "not logged in" in browser.page_source
    click(browser, By.ID, "action-requeue")
    assert shows(browser, "#heading", "Refused")
    assert job(db.engine, dead_id) is None  # still dead


def test_a_job_page_draws_its_graph_in_the_states_colours_and_its_nodes_open_their_jobs(
        db: Database, browser: Any, site: str) -> None:
    ids = mixed_graph(db.engine)
    browser.get(site + f"/jobs/{ids['join']}")
    graph = wait(browser).until(lambda b: b.find_element(By.CSS_SELECTOR, "svg#graph"))
    assert graph.size["width"] > 400 and graph.size["height"] > 100  # drawn at its size, not collapsed

    def fill(job_id: int) -> str:
        return str(browser.execute_script(
            "return getComputedStyle(document.querySelector('#graph [data-job=\"' + arguments[0] + '\"] rect')).fill",
            str(job_id)))

    def background(css: str) -> str:
        return str(browser.execute_script("return getComputedStyle(document.querySelector(arguments[0]))"
                                          ".backgroundColor", css))

    # Each node has its state's colour: the same as that state's badge on the page.
    assert fill(ids["join"]) == background("#job-state") != "rgba(0, 0, 0, 0)"  # the job itself: blocked
    assert fill(ids["later"]) == background("#upstreams .badge.state-pending")
    assert fill(ids["bad"]) == background("#upstreams .badge.state-dead")
    assert len({fill(ids["join"]), fill(ids["later"]), fill(ids["bad"])}) == 3
    # A node is a link to its job.
    click(browser, By.CSS_SELECTOR, f'#graph a[data-job="{ids["bad"]}"]')
    assert shows(browser, "#job-state", "dead")
    assert browser.current_url.endswith(f"/jobs/{ids['bad']}")
