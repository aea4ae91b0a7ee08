"""Seeing and steering durable jobs: ``jobs show`` and the dashboard list a job's steps, ``events emit``
wakes waiting jobs, and a parked job counts as scheduled (docs/howto/durable.md)."""

from __future__ import annotations

import json

from sqlalchemy.orm import Session

from tests import durable_app
from tests.conftest import Database, run_cli
from tests.dashboard_helpers import client
from tests.helpers import enqueue, job, run_burst

APP = ("--app", "tests.durable_app:queue")


def test_jobs_show_and_the_dashboard_list_the_steps_and_events_emit_wakes_the_job(db: Database) -> None:
    job_id = enqueue(db.engine, "d_wait", {"key": "order:7"})
    run_burst(db.engine)
    shown = run_cli("jobs", "show", str(job_id), *APP, env=db.env())
    assert shown.returncode == 0, shown.stderr
    assert "steps (2):" in shown.stdout
    assert "before" in shown.stdout and "waits for event 'order:7' until" in shown.stdout
    as_json = json.loads(run_cli("jobs", "show", str(job_id), *APP, "--json", env=db.env()).stdout)
    assert [(s["name"], s["awaiting"]) for s in as_json["steps"]] == [("before", None), ("event:order:7", "order:7")]
    html = client(db).get(f"/jobs/{job_id}").text
    assert 'id="steps"' in html and "<code>order:7</code>" in html and "<code>&#34;before&#34;</code>" in html
    stats = json.loads(run_cli("stats", *APP, "--json", env=db.env()).stdout)
    assert stats["scheduled"] == 1 and stats["running"] == 0 and stats["ready"] == 0  # parked: scheduled

    bad = run_cli("events", "emit", "order:7", "--data", "{not json", *APP, env=db.env())
    assert bad.returncode == 2 and "--data is not JSON" in bad.stderr
    emitted = run_cli("events", "emit", "order:7", "--data", '{"paid": 42}', *APP, env=db.env())
    assert emitted.returncode == 0, emitted.stderr
    assert "1 waiting job(s) due now" in emitted.stdout
    again = run_cli("events", "emit", "order:7", "--data", "1", *APP, env=db.env())
    assert "emitted before: nothing changed" in again.stdout
    run_burst(db.engine)
    done = job(db.engine, job_id)
    assert done is not None and done.state == "finished" and done.result == {"data": {"paid": 42}}
    with Session(db.engine) as session:
        assert [s.finished_at is not None for s in durable_app.queue.job_steps(session, job_id)] == [True] * 3
    assert "sleeps until" not in run_cli("jobs", "show", str(job_id), *APP, env=db.env()).stdout
