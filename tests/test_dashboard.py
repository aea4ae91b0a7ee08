"""The dashboard's pages on real databases: figures equal ``queue.stats()``, filters, keyset paging,
a job's history, escaping, and the samples behind the charts (bounded, kept across restarts)."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session
from starlette.testclient import TestClient

from sqla_jobs.web import dashboard, record_sample, samples_table
from tests import app
from tests.conftest import Database
from tests.dashboard_helpers import client, figure, kill
from tests.helpers import enqueue, run_burst


def ids_on(html: str) -> list[int]:
    return [int(i) for i in re.findall(r'<tr class="state-\w+"><td><a href="[^"]*">(\d+)</a>', html)]


def test_overview_shows_the_figures_of_queue_stats(db: Database) -> None:
    kill(db, n=2)
    for _ in range(3):
        enqueue(db.engine, "record")
    enqueue(db.engine, "record", run_at=datetime.now(timezone.utc) + timedelta(hours=1))
    html = client(db).get("/").text
    stats = app.queue.stats(db.engine)
    assert (stats.ready, stats.scheduled, stats.dead_total) == (3, 1, 2)  # the test's own setup, checked
    assert figure(html, "ready") == str(stats.ready)
    assert figure(html, "scheduled") == str(stats.scheduled)
    assert figure(html, "running") == str(stats.running)
    assert figure(html, "dead") == str(stats.dead_total)
    assert figure(html, "oldest") != "-"  # three due jobs: the oldest has an age
    assert 'hx-trigger="every 5.0s"' in html  # the figures refresh themselves
    live = client(db).get("/figures").text
    assert figure(live, "ready") == "3" and "<html" not in live  # the fragment htmx swaps in


def test_api_stats_is_queue_stats(db: Database) -> None:
    enqueue(db.engine, "record")
    data = client(db).get("/api/stats").json()
    expected = app.queue.stats(db.engine).to_dict()
    assert {k: data[k] for k in ("ready", "scheduled", "running", "dead_total")} == {
        k: expected[k] for k in ("ready", "scheduled", "running", "dead_total")}


def test_jobs_filter_by_state_kind_queue_and_time(db: Database) -> None:
    a = enqueue(db.engine, "record", queue="mail")
    b = enqueue(db.engine, "noop")
    run_burst(db.engine)  # both finish
    c = enqueue(db.engine, "record", queue="mail")
    d = enqueue(db.engine, "noop")
    with db.engine.begin() as conn:  # d was created two days ago
        conn.execute(update(app.Job.__table__).where(app.Job.id == d)
                     .values(created_at=app.queue.driver(conn).ago(2 * 86400)))
    web = client(db)
    assert ids_on(web.get("/jobs").text) == [d, c, b, a]
    assert ids_on(web.get("/jobs", params={"state": "finished"}).text) == [b, a]
    assert ids_on(web.get("/jobs", params={"state": "pending", "kind": "record"}).text) == [c]
    assert ids_on(web.get("/jobs", params={"queue": "mail"}).text) == [c, a]
    assert ids_on(web.get("/jobs", params={"since": "1d"}).text) == [c, b, a]
    assert web.get("/jobs", params={"id": str(b)}, follow_redirects=True).url.path == f"/jobs/{b}"


def test_bad_filters_get_a_clear_error(db: Database) -> None:
    web = client(db)
    r = web.get("/jobs", params={"state": "exploded"})
    assert r.status_code == 400 and "unknown state" in r.text and "pending" in r.text
    r = web.get("/jobs", params={"since": "yesterday"})
    assert r.status_code == 400 and "is not a duration" in r.text
    r = web.get("/jobs", params={"id": "12; DROP TABLE jobs"})
    assert r.status_code == 400 and "not a job id" in r.text


def test_jobs_filter_by_unique_key_and_its_periods(db: Database) -> None:
    with Session(db.engine) as session, session.begin():
        keyed = app.queue.enqueue_unique(session, "record", {}, unique_key="order-42").id
        period = app.queue.enqueue_unique(session, "record", {}, unique_key="report", unique_period=3600).id
        app.queue.enqueue_unique(session, "record", {}, unique_key="order-420")
    plain = enqueue(db.engine, "record")
    web = client(db)
    page = web.get("/jobs", params={"unique_key": "order-42"}).text
    assert ids_on(page) == [keyed] and "order-42" in page
    assert ids_on(web.get("/jobs", params={"unique_key": "report"}).text) == [period]  # its period, report@...
    assert ids_on(web.get("/jobs", params={"unique_key": "%"}).text) == []  # a LIKE wildcard matches nothing
    assert plain in ids_on(web.get("/jobs").text)


def test_filters_are_bound_parameters(db: Database) -> None:
    enqueue(db.engine, "record")
    web = client(db)
    for attack in ("x' OR '1'='1", "record' --", "%"):
        r = web.get("/jobs", params={"kind": attack, "queue": attack})
        assert r.status_code == 200 and ids_on(r.text) == [], attack
    assert len(ids_on(web.get("/jobs", params={"kind": "record"}).text)) == 1
    with db.engine.connect() as conn:  # and the tables are still there
        assert conn.scalar(select(func.count()).select_from(app.Job.__table__)) == 1


def test_keyset_pagination_walks_every_job_once(db: Database) -> None:
    with db.engine.begin() as conn:
        conn.execute(app.Job.__table__.insert(), [{"kind": "noop", "payload": {}} for _ in range(123)])
    web = client(db)
    seen: list[int] = []
    url: str | None = "/jobs"
    pages = 0
    while url:
        html = web.get(url).text
        seen += ids_on(html)
        pages += 1
        match = re.search(r'id="next" href="http://testserver([^"]+)"', html)
        url = match.group(1).replace("&amp;", "&") if match else None
    assert pages == 3
    assert seen == sorted(seen, reverse=True) and len(seen) == len(set(seen)) == 123


def test_pending_jobs_page_in_claim_order_each_once(db: Database) -> None:
    # Three priorities and runs of equal due times: the cursor (priority, run_at, id) must cross both.
    due = datetime.now(timezone.utc) - timedelta(hours=1)
    rows = [{"kind": "noop", "payload": {}, "priority": i % 3, "run_at": due + timedelta(seconds=i // 10)}
            for i in range(123)]
    with db.engine.begin() as conn:
        conn.execute(app.Job.__table__.insert(), rows)
        conn.execute(app.Job.__table__.insert().values(kind="noop", payload={}, state="finished"))  # not listed
    web = client(db)
    seen: list[int] = []
    url: str | None = "/jobs?state=pending"
    while url:
        html = web.get(url).text
        assert "In claim order" in html
        seen += ids_on(html)
        match = re.search(r'id="next" href="http://testserver([^"]+)"', html)
        url = match.group(1).replace("&amp;", "&") if match else None
    with db.engine.connect() as conn:
        t = app.Job.__table__
        expected = list(conn.scalars(select(t.c.id).where(t.c.state == "pending")
                                     .order_by(t.c.priority.desc(), t.c.run_at, t.c.id)))
    assert len(expected) == 123 and seen == expected
    bad = web.get("/jobs", params={"state": "pending", "after": "1~yesterday~3"})
    assert bad.status_code == 400 and "after must be" in bad.text


def test_every_timestamp_has_one_format(db: Database) -> None:
    # ISO-8601 to the second, UTC: lists, a job's fields and its error history alike, on every backend.
    done = enqueue(db.engine, "record")
    run_burst(db.engine)
    [dead_id] = kill(db)  # with its failure in `errors`
    web = client(db)
    moment = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")
    stamps = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d[^<]*")
    for page in (f"/jobs/{done}", "/jobs", "/dead", f"/jobs/{dead_id}"):
        html = web.get(page).text
        found = stamps.findall(html)
        assert found, page
        assert all(moment.fullmatch(s.split(" (")[0].strip()) for s in found), (page, found)
    assert "attempt 1</strong> at " in web.get(f"/jobs/{dead_id}").text


def test_job_page_shows_errors_per_attempt_timings_and_lease_owner(db: Database) -> None:
    job_id = enqueue(db.engine, "flaky", {"succeed_on": 3}, max_attempts=5)
    for _ in range(3):
        with db.engine.begin() as conn:  # the retry is due at once
            conn.execute(update(app.Job.__table__).where(app.Job.id == job_id)
                         .values(run_at=app.queue.driver(conn).ago(1)))
        run_burst(db.engine, name="the-worker")
    html = client(db).get(f"/jobs/{job_id}").text
    assert 'id="job-state">finished<' in html
    assert "attempt 1</strong>" in html and "attempt 2</strong>" in html and "attempt 3</strong>" not in html
    assert "ConnectionError: attempt 1 failed" in html
    assert re.search(r'id="lease-owner">[^<]*the-worker', html)
    assert "ran (claim → end)</th><td>" in html and "ran (claim → end)</th><td>-" not in html


def test_job_page_shows_result_and_progress_as_escaped_text(db: Database) -> None:
    job_id = enqueue(db.engine, "result_value", {"value": {"rows": 12, "note": "<b>bold</b>"},
                                                 "progress": [{"done": 12}]})
    run_burst(db.engine)
    html = client(db).get(f"/jobs/{job_id}").text
    assert "<h2>Result</h2>" in html and "&#34;rows&#34;: 12" in html.replace("&quot;", "&#34;")
    assert "<h2>Progress</h2>" in html and "<b>bold" not in html
    plain = client(db).get(f"/jobs/{enqueue(db.engine, 'record')}").text
    assert "<h2>Result</h2>" not in plain  # nothing returned, nothing shown


def test_payloads_and_errors_render_as_text(db: Database) -> None:
    evil = "<script>alert('x')</script>"
    job_id = enqueue(db.engine, "record", {"note": evil, "<b>key</b>": 1})
    [dead_id] = kill(db, message='<img src=x onerror="alert(1)">')
    web = client(db)
    for path in (f"/jobs/{job_id}", f"/jobs/{dead_id}", "/dead", "/jobs"):
        html = web.get(path).text
        assert "<script>alert" not in html and "<img src=x" not in html and "<b>key" not in html, path
    assert "&lt;script&gt;alert(" in web.get(f"/jobs/{job_id}").text
    assert "&lt;img src=x onerror=" in web.get(f"/jobs/{dead_id}").text


def test_dead_letters_by_kind(db: Database) -> None:
    fails = kill(db, n=2)
    web = client(db)
    html = web.get("/dead").text
    assert "fail (2)" in html and all(f">{i}</a>" in html for i in fails)
    assert "no dead jobs" in web.get("/dead", params={"kind": "other"}).text


def test_unknown_job_is_a_404_with_an_explanation(db: Database) -> None:
    r = client(db).get("/jobs/424242")
    assert r.status_code == 404 and "no job 424242" in r.text.lower()


def test_samples_feed_the_charts_and_survive_a_restart(db: Database) -> None:
    kill(db)
    # A job that failed once and waits for its retry in an hour.
    enqueue(db.engine, "flaky", attempts=1, run_at=datetime.now(timezone.utc) + timedelta(hours=1))
    enqueue(db.engine, "record", queue="mail")
    first = client(db, sample_interval=60)
    page = first.get("/").text  # the page writes the first sample
    assert figure(page, "retrying") == "1" == str(app.queue.stats(db.engine).retrying_total)
    restarted = TestClient(dashboard(db.engine, app.queue))  # a new app reads the same history
    data = restarted.get("/api/series", params={"span": "day"}).json()
    assert len(data["times"]) == 1
    assert data["series"]["ready"] == {"mail": [1.0], "default": [0.0]}  # the retry is scheduled, not ready
    assert data["series"]["dead"] == {"fail": [1.0]}
    assert data["series"]["retrying"] == {"flaky": [1.0]}


def test_samples_are_pruned_and_written_at_most_once_per_interval(db: Database) -> None:
    table = samples_table(app.queue)
    record_sample(db.engine, app.queue)
    with db.engine.begin() as conn:  # pretend that sample is three days old
        conn.execute(update(table).values(taken_at=datetime.now(timezone.utc) - timedelta(days=3)))
    web = client(db, sample_interval=60, keep=86400)
    web.get("/")
    web.get("/")  # within the interval: no second sample
    with db.engine.connect() as conn:
        rows = conn.execute(select(table.c.taken_at)).fetchall()
    stamps = {str(r.taken_at) for r in rows}
    assert len(stamps) == 1  # the old one pruned, one new sample
    assert record_sample(db.engine, app.queue, keep=86400) > 0


def test_samples_table_joins_the_apps_metadata_only_when_declared(tmp_path: object) -> None:
    from sqlalchemy import create_engine, inspect
    from sqlalchemy.orm import DeclarativeBase

    from sqla_jobs import DeadJobMixin, JobMixin, JobQueue

    class Base(DeclarativeBase):
        pass

    class OwnJob(JobMixin, Base):
        __tablename__ = "own_jobs"

    class OwnDead(DeadJobMixin, Base):
        __tablename__ = "own_dead"

    own = JobQueue(OwnJob, OwnDead)
    engine = create_engine(f"sqlite:///{tmp_path}/own.db")
    Base.metadata.create_all(engine)
    dashboard(engine, own)
    record_sample(engine, own)  # creates the table from the dashboard's own metadata
    assert "own_jobs_samples" not in Base.metadata.tables  # the app's metadata is left alone
    declared = samples_table(own, Base.metadata)
    assert Base.metadata.tables["own_jobs_samples"] is declared and samples_table(own) is declared
    Base.metadata.create_all(engine)
    assert inspect(engine).has_table("own_jobs_samples")
    assert record_sample(engine, own) > 0


def test_the_wheel_ships_the_templates_scripts_and_their_licences() -> None:
    from importlib import resources

    from tests.conftest import ROOT

    web = resources.files("sqla_jobs.web")
    for name in ("htmx-2.0.11.min.js", "uPlot-1.6.32.iife.min.js", "uPlot-1.6.32.min.css", "dashboard.js",
                 "LICENSE-htmx", "LICENSE-uPlot"):
        assert web.joinpath("static", name).is_file(), name
    assert web.joinpath("templates", "overview.html").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"sqla_jobs.web" = ["templates/*.html", "static/*"]' in pyproject  # package-data: wheels carry them
    import tomllib

    assert "sqla_jobs.web" in tomllib.loads(pyproject)["tool"]["setuptools"]["packages"]


def test_the_app_object_mounts_its_own_dashboard(db: Database) -> None:
    enqueue(db.engine, "noop")
    page = TestClient(app.queue.dashboard(db.engine)).get("/")
    assert page.status_code == 200
    assert figure(page.text, "ready") == str(app.queue.stats(db.engine).ready) == "1"
