"""An async app's URL and engine work everywhere the worker takes them (issue 30, findings 1 and 2).

The FastAPI how-to leads to ``sqlite+aiosqlite:///…`` / ``postgresql+psycopg_async://…``; with it in
``SQLA_JOBS_URL`` once, every admin command and the dashboard must work as they do on a sync URL.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from sqlalchemy import make_url
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from sqla_jobs.drivers import driver_class
from sqla_jobs.web import dashboard, record_sample
from tests import app
from tests.conftest import Database, run_cli
from tests.dashboard_helpers import kill
from tests.helpers import enqueue, run_burst
from tests.test_cli import APP, clean_env
from tests.test_dashboard_security import _cli, _free_port, _wait_for


def async_url(db: Database) -> str:
    url = make_url(db.url)
    return driver_class(url.get_backend_name()).async_url(url).render_as_string(hide_password=False)


def test_every_admin_command_takes_the_async_url(db: Database) -> None:
    env = clean_env(SQLA_JOBS_URL=async_url(db))
    done = enqueue(db.engine, "noop")
    run_burst(db.engine)
    [gone] = kill(db)
    waiting = enqueue(db.engine, "noop")
    commands = [
        ("create-tables",),
        ("stats",),
        ("stats", "--json"),
        ("jobs", "list"),
        ("jobs", "show", str(done)),
        ("jobs", "retry", str(waiting)),
        ("dead", "list"),
        ("dead", "show", str(gone)),
        ("health", "--max-oldest-age", "1h"),
        ("prune", "--finished-older-than", "1d"),
        ("dead", "purge", "--older-than", "30d"),
        ("jobs", "cancel", str(waiting)),
        ("dead", "retry", str(gone)),
    ]
    for command in commands:
        result = run_cli(*command, *APP, env=env)
        assert result.returncode == 0, (command, result.stderr)
        assert "Traceback" not in result.stderr and "MissingGreenlet" not in result.stderr, (command, result.stderr)
    listed = run_cli("jobs", "list", "--json", *APP, env=env)
    states = {row["id"]: row["state"] for row in json.loads(listed.stdout)}
    assert states[done] == "finished" and states[waiting] == "cancelled" and states[gone] == "pending"


def test_the_dashboard_command_takes_the_async_url(db: Database) -> None:
    enqueue(db.engine, "record")
    port = _free_port()
    proc = _cli(db, "--port", str(port), SQLA_JOBS_URL=async_url(db))
    try:
        body = _wait_for(f"http://127.0.0.1:{port}/jobs", proc)
        assert "record" in body
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "Traceback" not in out and "cannot write samples" not in out, out


def test_dashboard_of_an_async_engine_in_an_asgi_app(db: Database, caplog: pytest.LogCaptureFixture) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    job_id = enqueue(db.engine, "record")
    engine = create_async_engine(async_url(db))
    api = Starlette(routes=[Mount("/jobs", dashboard(engine, app.queue))])
    try:
        with caplog.at_level(logging.WARNING, logger="sqla_jobs"), TestClient(api) as web:
            overview = web.get("/jobs/")
            assert overview.status_code == 200 and 'id="fig-ready">1<' in overview.text
            listing = web.get("/jobs/jobs")
            assert listing.status_code == 200 and f">{job_id}</a>" in listing.text
            assert web.get(f"/jobs/jobs/{job_id}").status_code == 200
            series = web.get("/jobs/api/series").json()
            assert series  # the sample the overview wrote is there
        assert not [r for r in caplog.records if "cannot write samples" in r.getMessage()], caplog.text
        assert record_sample(engine, app.queue) > 0  # cron's writer takes the app's engine too
    finally:
        asyncio.run(engine.dispose())


def test_the_async_worker_and_an_admin_command_agree_on_the_url(db: Database) -> None:
    # The worker picks the async worker by itself for the async URL; stats then reads what it did.
    env = clean_env(SQLA_JOBS_URL=async_url(db))
    enqueue(db.engine, "noop")
    worker = run_cli("worker", "--burst", *APP, env=env)
    assert worker.returncode == 0, worker.stderr
    assert "(async)" in worker.stderr
    stats: dict[str, Any] = json.loads(run_cli("stats", "--json", *APP, env=env).stdout)
    assert stats["ready"] == 0
