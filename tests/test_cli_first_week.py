"""A new user's stumbles with the command (issue 30), each run in a subprocess as the user ran it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests import app, forkserver
from tests.conftest import ROOT, Database, run_cli
from tests.helpers import enqueue, job
from tests.test_cli import APP, assert_clean_error, clean_env

EMPTY_APP = '''
from sqlalchemy.orm import DeclarativeBase

from sqla_jobs import DeadJobMixin, JobMixin, JobQueue


class Base(DeclarativeBase):
    pass


class Job(JobMixin, Base):
    __tablename__ = "jobs"


class DeadJob(DeadJobMixin, Base):
    __tablename__ = "dead_jobs"


queue = JobQueue(Job, DeadJob)  # the handlers live in a module nobody imports
'''


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_worker_whose_app_has_no_handlers_refuses_to_start(db: Database, tmp_path: Path, processes: str) -> None:
    (tmp_path / "empty_app.py").write_text(EMPTY_APP)
    waiting = enqueue(db.engine, "noop")
    env = db.env(PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    result = run_cli("worker", "--burst", "--processes", processes, "--app", "empty_app:queue", env=env)
    assert_clean_error(result, 2, "--app 'empty_app:queue' has no handlers", "@queue.handler")
    row = job(db.engine, waiting)
    assert row is not None and row.state == "pending" and row.attempts == 0  # no attempt burnt


@pytest.mark.parametrize(
    ("files", "spec", "fragments"),
    [
        # The module is there; a dependency it imports is not installed: say so, not "add it to PYTHONPATH".
        ({"shop_jobs.py": "import stripe_sdk_not_installed\n"}, "shop_jobs:queue",
         ("'shop_jobs' was found, but it imports 'stripe_sdk_not_installed', which is not installed",
          "pip install stripe_sdk_not_installed")),
        # An ImportError of another kind inside the module.
        ({"shop_jobs.py": "from os import no_such_name\n"}, "shop_jobs:queue",
         ("'shop_jobs' was found, but an import in it failed", "no_such_name")),
        # The module itself is not there (in a package that is): the path advice is the right one.
        ({"shop/__init__.py": ""}, "shop.jobs:queue", ("cannot import 'shop.jobs'", "PYTHONPATH")),
        ({}, "no_such_module_xyz:queue", ("cannot import 'no_such_module_xyz'", "PYTHONPATH")),
    ],
)
def test_an_app_that_cannot_be_imported_says_which_import_failed(
    files: dict[str, str], spec: str, fragments: tuple[str, ...], tmp_path: Path
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = clean_env(PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    result = run_cli("worker", "--burst", "--url", f"sqlite:///{tmp_path / 'x.db'}", "--app", spec, env=env)
    error = assert_clean_error(result, 2, *fragments)
    if "was found" in error:
        assert "PYTHONPATH" not in error, error


def test_log_level_after_the_command(db: Database) -> None:
    enqueue(db.engine, "noop")
    quiet = run_cli("worker", "--burst", "--log-level", "WARNING", *APP, env=db.env())
    assert quiet.returncode == 0, quiet.stderr
    assert "INFO" not in quiet.stderr  # neither the start line nor the job's line
    loud = run_cli("jobs", "list", "--json", "--log-level", "DEBUG", *APP, env=db.env())
    assert loud.returncode == 0, loud.stderr
    assert len(json.loads(loud.stdout)) == 1
    before = run_cli("--log-level", "ERROR", "stats", *APP, env=db.env())  # the old place still works
    assert before.returncode == 0, before.stderr
    bad = run_cli("stats", "--log-level", "LOUD", *APP, env=db.env())
    assert bad.returncode == 2 and "invalid choice: 'LOUD'" in bad.stderr


def test_dashboard_actions_without_a_credential_names_the_flags(tmp_path: Path) -> None:
    env = clean_env(SQLA_JOBS_URL=f"sqlite:///{tmp_path / 'x.db'}")  # refused before any database is opened
    result = run_cli("dashboard", "--actions", "--port", "1", *APP, env=env)
    error = assert_clean_error(result, 2, "--actions needs a credential", "--token-env VAR", "--basic-auth-env VAR")
    assert "actions=True" not in error and "token=" not in error
    empty_password = run_cli("dashboard", "--actions", "--basic-auth-env", "ADMIN_PAIR", "--port", "1", *APP,
                             env={**env, "ADMIN_PAIR": "admin:"})
    error = assert_clean_error(empty_password, 2, "--basic-auth-env ADMIN_PAIR", "USER:PASSWORD")
    assert "basic_auth" not in error


def test_a_list_cut_by_its_limit_says_so(db: Database) -> None:
    from tests.dashboard_helpers import kill

    kill(db, n=3)
    for _ in range(4):
        enqueue(db.engine, "noop")
    cut = run_cli("jobs", "list", "--limit", "3", *APP, env=db.env())
    assert cut.returncode == 0, cut.stderr
    assert "3 job(s), newest first (only the first 3: more match; raise --limit" in cut.stdout, cut.stdout
    whole = run_cli("jobs", "list", "--limit", "4", *APP, env=db.env())
    assert "4 job(s), newest first" in whole.stdout and "more match" not in whole.stdout, whole.stdout
    as_json = run_cli("jobs", "list", "--json", "--limit", "3", *APP, env=db.env())
    assert len(json.loads(as_json.stdout)) == 3
    dead = run_cli("dead", "list", "--limit", "2", *APP, env=db.env())
    assert "2 dead job(s), latest failure first (only the first 2: more match" in dead.stdout, dead.stdout
    every = run_cli("dead", "list", "--limit", "3", *APP, env=db.env())
    assert "3 dead job(s)" in every.stdout and "more match" not in every.stdout, every.stdout


def test_demo_on_a_path_it_cannot_create_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir" / "x.db"
    result = run_cli("demo", "--db", str(missing), env=clean_env())
    assert_clean_error(result, 2, f"--db {missing}", f"the folder {missing.parent} does not exist")
    folder = run_cli("demo", "--db", str(tmp_path), env=clean_env())
    assert_clean_error(folder, 2, f"--db {tmp_path}: that is a folder")
    assert not missing.parent.exists()


def test_a_requeue_is_in_the_history_dead_show_and_jobs_show_print(db: Database) -> None:
    from tests.dashboard_helpers import client, kill
    from tests.helpers import run_burst

    [job_id] = kill(db, message="smtp down")
    retried = run_cli("dead", "retry", str(job_id), *APP, env=db.env())
    assert retried.returncode == 0, retried.stderr
    shown = run_cli("jobs", "show", str(job_id), *APP, env=db.env())
    assert "requeued from the dead-letter table: attempts start again from 1" in shown.stdout, shown.stdout
    run_burst(db.engine)  # it fails its one attempt again: dead again
    history = run_cli("dead", "show", str(job_id), *APP, env=db.env())
    assert history.returncode == 0, history.stderr
    after = history.stdout.split("errors (3):\n", 1)
    assert len(after) == 2, history.stdout
    lines = [ln.strip() for ln in after[1].splitlines() if ln.strip()]
    assert len(lines) == 3, history.stdout
    assert lines[0].startswith("attempt 1 at ") and "smtp down" in lines[0]
    assert lines[1].startswith("at ") and "requeued from the dead-letter table" in lines[1]
    assert lines[2].startswith("attempt 1 at ") and "smtp down" in lines[2]
    page = client(db).get(f"/jobs/{job_id}").text  # the dashboard's job page: the same history
    assert "requeued from the dead-letter table" in page and "attempt None" not in page


def test_the_docs_speak_to_the_reader_and_name_versions_right() -> None:
    docs = ROOT / "docs"
    for page in docs.rglob("*.md"):
        assert "the article this project started from" not in page.read_text(), page
    migrations = (docs / "howto" / "migrations.md").read_text()
    assert "After 0.1, [unique jobs]" not in migrations  # 0.1.0 has the unique columns
    assert "Tables created by 0.1.0 have everything for [unique jobs]" in migrations


PRINTING_APP = EMPTY_APP.replace("# the handlers live in a module nobody imports", "") + '''

@queue.handler("shout")
def shout(payload: dict) -> None:
    print("x" * 20_000, flush=True)  # a handler's own output, more than a pipe holds
'''


def test_a_handlers_print_into_a_closed_pipe_fails_no_job(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "printing_app.py").write_text(PRINTING_APP)
    env = clean_env(PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", SQLA_JOBS_URL=f"sqlite:///{tmp_path / 'p.db'}",
                    SQLA_JOBS_APP="printing_app:queue")
    assert run_cli("create-tables", env=env).returncode == 0
    enqueue_code = ("from sqlalchemy import create_engine\nfrom sqlalchemy.orm import Session\n"
                    "from printing_app import Job\n"
                    f"engine = create_engine('sqlite:///{tmp_path / 'p.db'}')\n"
                    "with Session(engine) as s, s.begin():\n    s.add_all([Job(kind='shout', payload={}) "
                    "for _ in range(5)])\n")
    assert forkserver.run([sys.executable, "-c", enqueue_code], env=env, cwd=tmp_path).returncode == 0
    # `sqla-jobs worker --burst | head -c 0`: the reader is gone before the first job runs.
    worker = forkserver.Popen([sys.executable, "-m", "sqla_jobs.cli", "worker", "--burst"], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert worker.stdout is not None
    worker.stdout.close()
    _, err = worker.communicate(timeout=120)
    assert worker.returncode == 0, err
    assert "BrokenPipeError" not in err, err
    assert "handlers' output is discarded" in err
    listed = run_cli("jobs", "list", "--json", env=env)
    assert [row["state"] for row in json.loads(listed.stdout)] == ["finished"] * 5, listed.stdout


def test_one_flag_picks_the_workers_lanes_and_the_docs_say_so(db: Database) -> None:
    # The decision of issue 30 #15: `--queue NAME` is the flag; `--queues a,b` is its shorthand, same result.
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    assert "lanes are chosen with one flag, `--queue NAME`" in glossary
    assert "`--queues a,b` is a\n  shorthand for `--queue a --queue b`" in glossary
    cli = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert "a shorthand for `--queue Q1 --queue Q2`" in cli and "the worker's lanes" in cli
    helped = " ".join(run_cli("worker", "--help").stdout.split())  # the help says it too, where it is read first
    assert "a lane (a job's queue= name)" in helped and "shorthand for --queue a --queue b" in helped, helped
    for flags in (["--queue", "mail", "--queue", "reports"], ["--queues", "mail,reports"]):
        ids = {q: enqueue(db.engine, "noop", queue=q) for q in ("mail", "reports", "other")}
        result = run_cli("worker", "--burst", *flags, *APP, env=db.env())
        assert result.returncode == 0, result.stderr
        states = {q: job(db.engine, i).state for q, i in ids.items()}  # type: ignore[union-attr]
        assert states == {"mail": "finished", "reports": "finished", "other": "pending"}, (flags, states)
        with db.engine.begin() as conn:  # the next round starts from an empty table
            conn.execute(app.Job.__table__.delete())
