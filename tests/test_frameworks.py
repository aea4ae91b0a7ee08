"""The framework recipes of docs/howto/frameworks.md run as printed: FastAPI, Flask-SQLAlchemy, a cron script.

The example files live in docs/examples/ and the page shows them word for word (checked here).
"""

from __future__ import annotations

import importlib.util
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session

from sqla_jobs.testing import assert_enqueued, run_due
from tests import forkserver
from tests.conftest import ROOT, Database, make_database

EXAMPLES = ROOT / "docs" / "examples"
PAGE = ROOT / "docs" / "howto" / "frameworks.md"


def load(name: str) -> ModuleType:
    """Import docs/examples/NAME.py as a reader's project would (the folder on sys.path)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from make_database(request.param, tmp_path)


def test_the_page_shows_each_example_file_word_for_word() -> None:
    shown = dict(re.findall(r"```python\n# (\w+\.py)\n(.*?)```", PAGE.read_text(), re.S))
    files = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert sorted(shown) == files
    for name in files:
        assert f"# {name}\n{shown[name]}" == (EXAMPLES / name).read_text(), f"{name} differs from the page"


def test_fastapi_enqueues_in_the_requests_transaction_and_a_worker_runs_beside_it(database: Database) -> None:
    from fastapi.testclient import TestClient

    shop = load("fastapi_app")
    with TestClient(shop.create_app(database.url, run_worker=True)) as client:
        created = client.post("/orders", json={"email": "ada@example.com"})
        assert created.status_code == 201, created.text
        order_id = created.json()["id"]
        deadline = time.monotonic() + 60
        while not client.get(f"/orders/{order_id}").json()["confirmed"]:  # the worker thread's doing
            assert time.monotonic() < deadline, "the worker beside the app never confirmed the order"
            time.sleep(0.05)
        assert client.post("/orders", json={"email": "nope"}).status_code == 422  # rolled back: no job either
    with Session(database.engine) as session:
        assert session.scalar(select(func.count()).select_from(shop.Order)) == 1
        assert session.scalars(select(shop.Job.state)).all() == ["finished"]


def test_fastapi_answers_only_after_the_commit(database: Database) -> None:
    from fastapi.testclient import TestClient

    shop = load("fastapi_app")

    def refuse(session: Session) -> None:
        if session.info.get("refuse"):  # this transaction flushed the order and its job
            raise RuntimeError("the database refused the commit")

    def mark(session: Session, _ctx: Any) -> None:
        session.info["refuse"] = True

    with TestClient(shop.create_app(database.url), raise_server_exceptions=False) as client:
        event.listen(Session, "after_flush", mark)
        event.listen(Session, "before_commit", refuse)
        try:
            answer = client.post("/orders", json={"email": "ada@example.com"})
        finally:
            event.remove(Session, "before_commit", refuse)
            event.remove(Session, "after_flush", mark)
        # A failed commit is an error response, never a 201 for an order that does not exist.
        assert answer.status_code == 500
    with Session(database.engine) as session:
        assert session.scalar(select(func.count()).select_from(shop.Job)) == 0


def test_flask_sqlalchemy_view_commits_the_order_and_its_job(database: Database) -> None:
    shop = load("flask_app")
    app = shop.create_app(database.url)
    client = app.test_client()
    created = client.post("/orders", json={"email": "ada@example.com"})
    assert created.status_code == 201, created.get_data(as_text=True)
    order_id = created.get_json()["id"]
    assert client.post("/orders", json={"email": "nope"}).status_code == 422
    with app.app_context():
        assert_enqueued(shop.db.engine, shop.queue, "confirm_order", {"order_id": order_id}, count=1)
        assert not client.get(f"/orders/{order_id}").get_json()["confirmed"]
        # What `sqla-jobs worker --app flask_app:queue` does, in this process.
        report = run_due(shop.db.engine, shop.queue).raise_errors()
        assert [e.kind for e in report.finished] == ["confirm_order"]
        assert client.get(f"/orders/{order_id}").get_json()["confirmed"]
        shop.db.engine.dispose()


def test_a_cron_script_enqueues_and_a_burst_worker_drains(database: Database) -> None:
    env = database.env(PYTHONPATH=f"{EXAMPLES}{':'}{ROOT}")
    enqueued = forkserver.run([sys.executable, str(EXAMPLES / "cron_enqueue.py"), database.url], env=env,
                              capture_output=True, text=True, timeout=120)
    assert enqueued.returncode == 0, enqueued.stderr
    assert "enqueued 3 report jobs" in enqueued.stdout
    # The crontab line of the page, minus the schedule.
    worker = forkserver.run([sys.executable, "-m", "sqla_jobs.cli", "worker", "--burst", "--url", database.url,
                             "--app", "cron_jobs:queue"], env=env, capture_output=True, text=True, timeout=120)
    assert worker.returncode == 0, worker.stderr
    jobs = load("cron_jobs")
    with Session(database.engine) as session:
        assert sorted(session.scalars(select(jobs.Report.customer))) == ["acme", "globex", "initech"]
        assert set(session.scalars(select(jobs.Job.state))) == {"finished"}
