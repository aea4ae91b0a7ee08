"""Batches as users meet them, on every backend: four ``sqla-jobs worker`` processes run a batch's members and
its callbacks exactly once, after the last member ended by the database clock; a member's handler grows its own
batch; ``sqla-jobs batches list/show`` and ``jobs show`` (in a subprocess); the dashboard's batch pages."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from sqla_jobs import Batch
from tests import app
from tests.conftest import Database, run_cli
from tests.dashboard_helpers import client
from tests.test_concurrency import _run_burst_workers

APP = ("--app", "tests.app:queue")
MEMBERS = 300


def _starts(session: Session, job_id: int) -> int:
    return len(list(session.scalars(select(app.Effect.id).where(app.Effect.job_id == job_id,
                                                                app.Effect.event == "start"))))


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["threaded", "async"])
def test_four_workers_run_each_callback_once_after_the_last_member_ended(db: Database, flavour: str) -> None:
    report = "batch_report_async" if flavour == "async" else "batch_report"
    batch = Batch(on_complete=app.Job(kind=report, payload={}), on_success=app.Job(kind=report, payload={}),
                  on_failure=app.Job(kind=report, payload={}), label="import")
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        # Half through the ORM, half through enqueue_many (COPY on PostgreSQL); two members fail for good,
        # one grows the batch from its handler.
        session.add_all(app.Job(kind="record", payload={}, batch=batch) for _ in range(MEMBERS // 2 - 3))
        session.add_all(app.Job(kind="fail", payload={}, max_attempts=1, batch=batch) for _ in range(2))
        session.add(app.Job(kind="grow", payload={"more": 5}, batch=batch))
        app.queue.enqueue_many(session, [{"kind": "record", "payload": {}}] * (MEMBERS // 2), batch=batch)
    _run_burst_workers(db, flavour)
    callbacks = {name: job.id for name, job in batch.callbacks.items()}
    with Session(db.engine) as session:
        rows = {name: session.get(app.Job, i) for name, i in callbacks.items()}
        starts = {name: _starts(session, i) for name, i in callbacks.items()}
        last = session.scalar(select(func.max(app.Job.finished_at)).where(app.Job.id.not_in(callbacks.values())))
        last_dead = session.scalar(select(func.max(app.DeadJob.failed_at)))
        members = Counter(session.scalars(select(app.Job.state).where(app.Job.id.not_in(callbacks.values()))))
    total = MEMBERS + 5
    assert members == {"finished": total - 2}
    assert starts == {"on_complete": 1, "on_failure": 1, "on_success": 0}
    assert rows["on_success"].state == "blocked"  # held by the two dead members until they are requeued
    for name in ("on_complete", "on_failure"):
        row = rows[name]
        assert (row.state, row.attempts) == ("finished", 1)
        assert row.locked_at >= max(last, last_dead)  # claimed after the last member ended, by the database clock
        assert row.result == {"total": total, "finished": total - 2, "dead": 2, "cancelled": 0, "waiting": 0}


def test_batches_list_and_show_and_jobs_show_on_the_command_line(db: Database) -> None:
    batch = Batch(on_complete=app.Job(kind="noop", payload={}), on_failure=app.Job(kind="noop", payload={}),
                  label="nightly import")
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        app.queue.enqueue_many(session, [{"kind": "noop", "payload": {}}] * 3, batch=batch)
        member = app.Job(kind="noop", payload={}, batch=batch)
        session.add(member)
    listed = run_cli("batches", "list", *APP, env=db.env())
    assert listed.returncode == 0, listed.stderr
    assert "nightly import" in listed.stdout and f"on_complete {batch.on_complete.id} blocked" in listed.stdout
    data = json.loads(run_cli("batches", "list", *APP, "--json", env=db.env()).stdout)
    assert [(b["id"], b["total"], b["label"]) for b in data] == [(batch.id, 4, "nightly import")]
    shown = run_cli("batches", "show", str(batch.id), *APP, env=db.env())
    assert shown.returncode == 0, shown.stderr
    assert "members   4: 4 member(s) still to end" in shown.stdout
    assert re.search(rf"on_failure\s+{batch.on_failure.id}\s+blocked", shown.stdout), shown.stdout
    counts = json.loads(run_cli("batches", "show", str(batch.id), *APP, "--json", env=db.env()).stdout)
    assert (counts["waiting"], counts["finished"], counts["complete"]) == (4, 0, False)
    job = run_cli("jobs", "show", str(member.id), *APP, env=db.env())
    assert f"batch {batch.id} (nightly import): `sqla-jobs batches show {batch.id}`" in job.stdout, job.stdout
    missing = run_cli("batches", "show", "987654", *APP, env=db.env())
    assert missing.returncode != 0 and "no batch with id 987654" in missing.stderr


def test_the_dashboard_lists_batches_and_shows_one_with_its_counts(db: Database) -> None:
    batch = Batch(on_complete=app.Job(kind="noop", payload={}), label="<b>export</b>")
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        members = [app.Job(kind="noop", payload={}, batch=batch) for _ in range(4)]
        session.add_all(members)
    with Session(db.engine) as session, session.begin():
        app.queue.cancel(session, members[0].id)
    web = client(db)
    listing = web.get("/batches").text
    assert f'href="http://testserver/batches/{batch.id}"' in listing
    assert "&lt;b&gt;export&lt;/b&gt;" in listing and "<b>export</b>" not in listing  # escaped
    page = web.get(f"/batches/{batch.id}").text
    counts: dict[str, Any] = dict(re.findall(r'<td id="count-(\w+)">(\d+)</td>', page))
    assert counts == {"finished": "0", "dead": "0", "cancelled": "1", "waiting": "3", "removed": "0"}
    assert re.search(r'class="part state-cancelled" style="width: 25.00%"', page)
    assert f'href="http://testserver/jobs/{batch.on_complete.id}"' in page
    job_page = web.get(f"/jobs/{members[1].id}").text
    assert f'href="http://testserver/batches/{batch.id}">batch {batch.id}' in job_page
    assert web.get("/batches/987654").status_code == 404
