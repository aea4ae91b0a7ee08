"""The ``sqla-jobs`` command, run in a subprocess exactly as a user runs it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from tests import app
from tests.conftest import ROOT, Database, run_cli
from tests.helpers import count, dead, enqueue, job, run_burst

APP = ("--app", "tests.app:queue")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any SQLA_JOBS_* setting, so only the command line counts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_JOBS_")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def assert_clean_error(result: object, code: int, *fragments: str) -> str:
    """One readable line on stderr naming the problem, the exit status, and no traceback."""
    assert result.returncode == code, (result.returncode, result.stderr)  # type: ignore[attr-defined]
    err: str = result.stderr.strip()  # type: ignore[attr-defined]
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("sqla-jobs: ")
    for fragment in fragments:
        assert fragment in err, err
    return err


# -- the commands ----------------------------------------------------------------------------------

def test_worker_burst_runs_every_due_job_and_logs_one_line_each(db: Database) -> None:
    ok = enqueue(db.engine, "noop")
    failing = enqueue(db.engine, "fail", {"message": "smtp down"}, max_attempts=2)
    result = run_cli("worker", "--burst", "--concurrency", "2", *APP, env=db.env())
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if re.search(r"job \d+ ", line)]
    pattern = r"job {id} {kind} attempt {n}/{max} \(\d+\.\d ms\): {result}"
    expected = [
        pattern.format(id=ok, kind="noop", n=1, max=5, result="finished"),
        pattern.format(id=failing, kind="fail", n=1, max=2, result=r"failed, retry in 0s: ValueError: smtp down"),
        pattern.format(id=failing, kind="fail", n=2, max=2,
                       result=r"failed for good, moved to dead letters: ValueError: smtp down"),
    ]
    for regex in expected:
        assert sum(bool(re.search(regex, line)) for line in lines) == 1, (regex, lines)
    assert len(lines) == 3
    assert job(db.engine, ok).state == "finished"  # type: ignore[union-attr]
    assert dead(db.engine, failing) is not None


def test_worker_burst_with_nothing_due_exits_0(db: Database) -> None:
    result = run_cli("worker", "--burst", *APP, env=db.env())
    assert result.returncode == 0, result.stderr
    assert "stopped after 0 job attempts" in result.stderr


def test_url_and_app_from_the_environment_or_flags(db: Database) -> None:
    enqueue(db.engine, "noop")
    env = clean_env(SQLA_JOBS_APP="tests.app:queue")
    result = run_cli("worker", "--burst", "--url", db.url, env=env)
    assert result.returncode == 0, result.stderr
    assert count(db.engine, app.Job, app.Job.state == "finished") == 1


def test_create_tables(db: Database) -> None:
    app.Base.metadata.drop_all(db.engine)
    result = run_cli("create-tables", *APP, env=db.env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "tables ready: jobs, dead_jobs"
    names = set(inspect(db.engine).get_table_names())
    assert {"jobs", "dead_jobs"} <= names
    assert "ix_jobs_pending" in {ix["name"] for ix in inspect(db.engine).get_indexes("jobs")}
    again = run_cli("create-tables", *APP, env=db.env())  # idempotent
    assert again.returncode == 0, again.stderr


def make_dead(db: Database, kind: str = "fail", n: int = 1) -> list[int]:
    ids = [enqueue(db.engine, kind, {"message": f"{kind} broke"}, max_attempts=1) for _ in range(n)]
    run_burst(db.engine)  # in-process: the worker's CLI is tested above
    assert count(db.engine, app.DeadJob, app.DeadJob.id.in_(ids)) == n
    return ids


def test_dead_list_text_and_json(db: Database) -> None:
    empty = run_cli("dead", "list", *APP, env=db.env())
    assert (empty.returncode, empty.stdout.strip()) == (0, "no dead jobs")
    [job_id] = make_dead(db)
    text = run_cli("dead", "list", *APP, env=db.env())
    assert text.returncode == 0, text.stderr
    # A table (rich's, or plain text without rich): check what it says, not its borders.
    cells = text.stdout.replace("│", " ").replace("┃", " ").split()
    assert {"id", "kind", "attempts", str(job_id), "fail", "ValueError:"} <= set(cells)
    assert "1 dead job(s)" in text.stdout
    as_json = run_cli("dead", "list", "--json", *APP, env=db.env())
    assert as_json.returncode == 0, as_json.stderr
    [item] = json.loads(as_json.stdout)
    assert (item["id"], item["kind"], item["attempts"]) == (job_id, "fail", 1)
    assert item["payload"] == {"message": "fail broke"}
    assert item["last_error"] == "ValueError: fail broke"
    assert [e["attempt"] for e in item["errors"]] == [1]
    by_kind = run_cli("dead", "list", "--kind", "noop", *APP, env=db.env())
    assert by_kind.stdout.strip() == "no dead jobs of kind 'noop'"
    unknown = run_cli("dead", "list", "--kind", "other", *APP, env=db.env())  # neither the app's nor the table's
    assert_clean_error(unknown, 2, "--kind 'other' matches nothing")


def test_dead_retry_by_id_kind_and_all(db: Database) -> None:
    app.queue.check_kinds = False
    try:
        a, b, c = make_dead(db, n=3)
        [other] = make_dead(db, kind="gone_kind")
    finally:
        app.queue.check_kinds = True
    by_id = run_cli("dead", "retry", str(a), *APP, env=db.env())
    assert (by_id.returncode, by_id.stdout.strip()) == (0, f"requeued 1 job(s): {a}"), by_id.stderr
    assert job(db.engine, a).attempts == 0  # type: ignore[union-attr]
    by_kind = run_cli("dead", "retry", "--kind", "fail", *APP, env=db.env())
    assert by_kind.stdout.strip() == f"requeued 2 job(s): {b}, {c}"
    assert dead(db.engine, other) is not None
    everything = run_cli("dead", "retry", "--all", *APP, env=db.env())
    assert everything.stdout.strip() == f"requeued 1 job(s): {other}"
    assert count(db.engine, app.DeadJob) == 0
    assert count(db.engine, app.Job, app.Job.state == "pending") == 4


def test_dead_retry_unknown_id_and_no_selection(db: Database) -> None:
    missing = run_cli("dead", "retry", "12345", *APP, env=db.env())
    assert_clean_error(missing, 2, "no dead job with id 12345")
    nothing = run_cli("dead", "retry", *APP, env=db.env())
    assert_clean_error(nothing, 2, "needs job ids, --kind KIND or --all")


def test_demo_in_a_fresh_directory(tmp_path: Path) -> None:
    path = tmp_path / "demo.db"
    result = run_cli("demo", "--db", str(path), env=clean_env())
    assert result.returncode == 0, result.stderr
    assert "Finished jobs: 4" in result.stdout
    assert re.search(r"Dead-lettered: job \d+ push_to_crm after 3 attempts: PermissionError", result.stdout)
    engine = create_engine(f"sqlite:///{path}")
    assert {"orders", "jobs", "dead_jobs"} <= set(inspect(engine).get_table_names())
    engine.dispose()


def test_tables_missing_says_how_to_create_them(db: Database) -> None:
    app.Base.metadata.drop_all(db.engine)
    for command in (["worker", "--burst"], ["dead", "list"], ["dead", "retry", "--all"]):
        result = run_cli(*command, *APP, env=db.env())
        assert_clean_error(result, 2, "does not exist", "sqla-jobs create-tables")


# -- configuration errors: one clear line, non-zero exit, no traceback ---------------------------------

@pytest.mark.parametrize(
    ("url", "code", "fragment"),
    [
        ("postgresql+psycopg://postgres@127.0.0.1:1/test", 1, "cannot reach the database"),
        ("sqlite:////nonexistent-dir/sub/jobs.db", 2, "no database at /nonexistent-dir/sub/jobs.db"),
        ("not a url", 2, "is not a database URL"),
        ("postgresql://u@localhost:port/db", 2, "is not a database URL"),
        ("oracle://u@localhost/db", 2, "not 'oracle'"),
    ],
)
def test_bad_url(url: str, code: int, fragment: str) -> None:
    result = run_cli("worker", "--burst", "--url", url, *APP, env=clean_env())
    assert_clean_error(result, code, fragment)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("no_such_module_xyz:queue", "cannot import 'no_such_module_xyz'"),
        ("broken_app:queue", "importing 'broken_app' raised SyntaxError"),
        ("raising_app:queue", "importing 'raising_app' raised RuntimeError: SECRET_KEY is not set"),
        ("tests.app:no_such_attr", "has no attribute 'no_such_attr'"),
        ("tests.app:Job", "is the class Job, not a sqla_jobs.JobQueue"),
        ("tests.app:engine", "is a function, not a sqla_jobs.JobQueue"),
        ("tests.app", "must look like 'package.module:queue'"),
    ],
)
def test_bad_app(spec: str, fragment: str, tmp_path: Path) -> None:
    (tmp_path / "broken_app.py").write_text("queue = (\n")
    (tmp_path / "raising_app.py").write_text("raise RuntimeError('SECRET_KEY is not set')\n")
    env = clean_env(PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    result = run_cli("worker", "--burst", "--url", f"sqlite:///{tmp_path / 'x.db'}", "--app", spec, env=env)
    assert_clean_error(result, 2, fragment)


def test_password_never_shown(tmp_path: Path) -> None:
    for url in ("postgresql+psycopg://app:s3cret@127.0.0.1:1/test", "postgresql://app:s3cret@localhost:port/db"):
        result = run_cli("worker", "--burst", "--url", url, *APP, env=clean_env())
        error = assert_clean_error(result, result.returncode, "app:***@")
        assert result.returncode in (1, 2) and "s3cret" not in error


def test_missing_url_and_app(tmp_path: Path) -> None:
    no_url = run_cli("worker", "--burst", *APP, env=clean_env())
    assert_clean_error(no_url, 2, "no database given", "--url", "SQLA_JOBS_URL")
    no_app = run_cli("dead", "list", "--url", f"sqlite:///{tmp_path / 'x.db'}", env=clean_env())
    assert_clean_error(no_app, 2, "no app given", "--app", "SQLA_JOBS_APP")


def test_bad_option_value(tmp_path: Path) -> None:
    result = run_cli("worker", "--concurrency", "0", "--url", f"sqlite:///{tmp_path / 'x.db'}", *APP,
                     env=clean_env())
    assert_clean_error(result, 2, "concurrency must be at least 1")


def test_worker_pool_fits_its_concurrency(pg: Database) -> None:
    """20 transactional handlers hold 20 connections at once: more than SQLAlchemy's default pool of 15."""
    app.queue.create_tables(pg.engine)
    ids = [enqueue(pg.engine, "rendezvous", {"parties": 20}, max_attempts=1) for _ in range(20)]
    result = run_cli("worker", "--burst", "--concurrency", "20", *APP, env=pg.env())
    assert result.returncode == 0, result.stderr
    assert count(pg.engine, app.Job, app.Job.id.in_(ids), app.Job.state == "finished") == 20, result.stderr
