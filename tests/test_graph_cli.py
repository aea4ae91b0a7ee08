"""Job graphs on the command line: `blocked` is a state of its own in `stats`, `health` and `jobs list`, and
`jobs show` names a job's upstreams and dependents. Each command runs in a subprocess, as a user runs it."""

from __future__ import annotations

import json

from sqlalchemy.orm import Session

from tests import app
from tests.conftest import Database, run_cli

APP = ("--app", "tests.app:queue")


def cells(text: str) -> list[list[str]]:
    """The rows of a table the CLI printed (rich's or plain text), as their cells split on blanks."""
    return [line.replace("│", " ").replace("┃", " ").split() for line in text.splitlines()]


def fan_in(db: Database, queue: str = "default") -> tuple[int, int, int]:
    """Two new upstreams and a job that depends on both: (first upstream, second upstream, dependent)."""
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        ups = [app.Job(kind="noop", payload={}, queue=queue) for _ in range(2)]
        join = app.Job(kind="join", payload={}, queue=queue, depends_on=ups)
        session.add(join)
    return ups[0].id, ups[1].id, join.id


def test_stats_and_health_count_blocked_jobs(db: Database) -> None:
    fan_in(db)
    fan_in(db, queue="graphs")
    table = run_cli("stats", *APP, env=db.env())
    assert table.returncode == 0, table.stderr
    rows = cells(table.stdout)
    assert ["blocked", "2"] in rows and ["ready", "4"] in rows
    # By queue: ready, scheduled, running, blocked, expired leases
    assert any(row[:6] == ["graphs", "2", "0", "0", "1", "0"] for row in rows), table.stdout
    data = json.loads(run_cli("stats", *APP, "--json", env=db.env()).stdout)
    assert data["blocked"] == 2 and {q["queue"]: q["blocked"] for q in data["queues"]} == {"default": 1, "graphs": 1}
    health = run_cli("health", *APP, "--max-oldest-age", "1h", env=db.env())
    assert health.returncode == 0, health.stderr
    assert "4 ready, 0 scheduled, 0 running, 2 blocked, 0 dead" in health.stdout


def test_jobs_list_state_blocked(db: Database) -> None:
    first, _, join = fan_in(db)
    listed = json.loads(run_cli("jobs", "list", *APP, "--state", "blocked", "--json", env=db.env()).stdout)
    assert [(r["id"], r["state"], r["waiting_for"]) for r in listed] == [(join, "blocked", 2)]
    table = run_cli("jobs", "list", *APP, "--state", "blocked", env=db.env())
    assert table.returncode == 0, table.stderr
    assert any(row[:4] == [str(join), "join", "default", "blocked"] for row in cells(table.stdout)), table.stdout
    assert str(first) not in [row[0] for row in cells(table.stdout) if row]
