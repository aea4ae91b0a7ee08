"""Job graphs on the command line: `blocked` is a state of its own in `stats`, `health` and `jobs list`, and
`jobs show` names a job's upstreams and dependents. Each command runs in a subprocess, as a user runs it."""

from __future__ import annotations

import json

from sqlalchemy.orm import Session

from tests import app
from tests.conftest import Database, run_cli
from tests.helpers import enqueue, mixed_graph

APP = ("--app", "tests.app:queue")
SHOWN = 50  # neighbours `jobs show` lists on each side (docs/reference/cli.md); --json lists them all


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


def lines_after(text: str, heading: str) -> list[list[str]]:
    """The indented lines under ``heading`` (a line starting with it), as their cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    block = []
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        block.append(line.split())
    return block


def test_jobs_show_names_upstreams_dependents_and_what_a_blocked_job_waits_for(db: Database) -> None:
    ids = mixed_graph(db.engine)
    shown = run_cli("jobs", "show", str(ids["join"]), *APP, env=db.env())
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "blocked: waits for 1 of its 3 upstream(s) to finish" in out
    assert "on_upstream_failure run: if an upstream fails, this job runs anyway" in out
    assert lines_after(out, "upstreams (3, in depends_on order):") == [
        [str(ids["ok"]), "gone", "no", "longer", "in", "the", "tables", "(pruned,", "or", "purged", "from", "the",
         "dead", "letters)"],
        [str(ids["bad"]), "dead", "fail", "was", "dead-lettered:", "counted", "as", "done"],
        [str(ids["later"]), "pending", "noop"],
    ]
    assert lines_after(out, "dependents (1, by id):") == [[str(ids["after"]), "blocked", "noop"]]

    data = json.loads(run_cli("jobs", "show", str(ids["join"]), *APP, "--json", env=db.env()).stdout)
    assert (data["state"], data["waiting_for"], data["on_upstream_failure"]) == ("blocked", 1, "run")
    assert data["upstreams"] == [
        {"id": ids["ok"], "kind": None, "state": "gone", "ended": None},
        {"id": ids["bad"], "kind": "fail", "state": "dead", "ended": "dead"},
        {"id": ids["later"], "kind": "noop", "state": "pending", "ended": None},
    ]
    assert data["dependents"] == [{"id": ids["after"], "kind": "noop", "state": "blocked", "ended": None}]

    # The default policy, said in words; and a job that waits for a dead upstream.
    after = run_cli("jobs", "show", str(ids["after"]), *APP, env=db.env()).stdout
    assert "on_upstream_failure cancel (the default): if an upstream fails, this job is cancelled" in after
    waiter = run_cli("jobs", "show", str(ids["waiter"]), *APP, env=db.env()).stdout
    assert "this job waits for a dead-lettered upstream to be requeued" in waiter
    assert lines_after(waiter, "upstreams (1,") == [[str(ids["bad"]), "dead", "fail", "dead-lettered"]]


def test_a_dead_job_shows_the_dependents_that_wait_for_it(db: Database) -> None:
    ids = mixed_graph(db.engine)
    for command in ("jobs", "dead"):  # `jobs show` finds it in the dead letters too
        shown = run_cli(command, "show", str(ids["bad"]), *APP, env=db.env())
        assert shown.returncode == 0, shown.stderr
        assert lines_after(shown.stdout, "dependents (2, by id):") == sorted([
            [str(ids["join"]), "blocked", "join", "does", "without", "this", "job,", "which", "was", "dead-lettered"],
            [str(ids["waiter"]), "blocked", "noop"],
        ], key=lambda row: int(row[0]))
        assert f"dependent(s) {ids['waiter']} wait for it: requeue it with `sqla-jobs dead retry {ids['bad']}`" \
            in shown.stdout
        assert "upstreams (" not in shown.stdout


def test_jobs_show_without_a_graph_is_unchanged_and_a_long_list_is_cut(db: Database) -> None:
    plain = enqueue(db.engine, "noop")
    shown = run_cli("jobs", "show", str(plain), *APP, env=db.env())
    assert shown.returncode == 0, shown.stderr
    assert not any(line.startswith(("upstreams (", "dependents (", "blocked:")) for line in shown.stdout.splitlines())
    data = json.loads(run_cli("jobs", "show", str(plain), *APP, "--json", env=db.env()).stdout)
    assert (data["upstreams"], data["dependents"]) == ([], [])

    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        source = app.Job(kind="noop", payload={})
        fan = [app.Job(kind="noop", payload={}, depends_on=[source]) for _ in range(SHOWN + 3)]
        session.add_all(fan)
    out = run_cli("jobs", "show", str(source.id), *APP, env=db.env()).stdout
    listed = lines_after(out, f"dependents ({SHOWN + 3}, by id):")
    assert [row[0] for row in listed[:-1]] == [str(j) for j in sorted(f.id for f in fan)][:SHOWN]
    assert listed[-1] == ["…", "and", "3", "more", "(--json", "lists", "them", "all)"]
    data = json.loads(run_cli("jobs", "show", str(source.id), *APP, "--json", env=db.env()).stdout)
    assert [d["id"] for d in data["dependents"]] == sorted(f.id for f in fan)


def test_jobs_cancel_a_blocked_job_and_its_dependents_hear_of_it(db: Database) -> None:
    ids = mixed_graph(db.engine)
    cancelled = run_cli("jobs", "cancel", str(ids["join"]), *APP, env=db.env())
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.strip() == f"job {ids['join']} cancelled: it will not run"
    after = json.loads(run_cli("jobs", "show", str(ids["after"]), *APP, "--json", env=db.env()).stdout)
    assert after["state"] == "cancelled" and f"upstream job {ids['join']} was cancelled" in after["last_error"]
    assert after["upstreams"] == [{"id": ids["join"], "kind": "join", "state": "cancelled", "ended": None}]
