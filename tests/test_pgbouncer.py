"""Workers behind a real PgBouncer in transaction pooling mode (issue 12, point 10).

The test starts PgBouncer itself (Debian's package, ``apt-get install pgbouncer``; ``.ci/run``
installs it) on a free port in front of the test server, with a small server pool handed out round
robin (``server_round_robin``), so a client's consecutive transactions run on different server
connections, as they do under load in production. psycopg prepares a statement once a
connection has run it five times; in transaction mode the next transaction may land on a server
connection without it (``prepared statement "_pg3_0" does not exist``). With
``?prepare_threshold=none`` in the URL nothing is prepared and workers drain cleanly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, insert, text

from tests import app, forkserver
from tests.conftest import ROOT
from tests.helpers import count
from tests.pgbouncer import running_pgbouncer
from tests.reliability.harness import wait_for


@pytest.fixture
def bouncer() -> Iterator[tuple[str, str]]:
    """(URL through PgBouncer, direct URL) of a fresh database; PgBouncer in transaction mode in front."""
    with running_pgbouncer() as urls:
        yield urls


def start_workers(url: str, processes: int, *options: str) -> list[forkserver.Popen]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_JOBS_")}
    env["PYTHONPATH"] = str(ROOT)
    argv = [sys.executable, "-m", "sqla_jobs.cli", "worker", "--url", url, "--app", "tests.app:queue",
            "--no-listen", "--burst", "--concurrency", "4", "--poll-interval", "0.05", *options]
    return [forkserver.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(processes)]


def enqueue_noops(direct: str, jobs: int) -> Engine:
    engine = create_engine(direct)
    app.queue.create_tables(engine)
    with engine.begin() as conn:
        conn.execute(insert(app.Job.__table__), [{"kind": "noop", "payload": {"n": i}} for i in range(jobs)])
    return engine


@pytest.mark.slow
def test_workers_drain_through_pgbouncer_transaction_mode(bouncer: tuple[str, str]) -> None:
    through, direct = bouncer
    engine = enqueue_noops(direct, 600)
    assert warm_server_connections(through, 4) == 4  # consecutive transactions go round the four servers
    # Two plain workers, and a supervisor of two (started first: its children start cold) whose children
    # must get the URL's setting too.
    workers = [*start_workers(f"{through}?prepare_threshold=none", 1, "--processes", "2")]
    wait_for(lambda: count(engine, app.Job, app.Job.state != "pending") >= 100, 60, "the supervised workers to start")
    workers += start_workers(f"{through}?prepare_threshold=none", 2)
    logs = [w.communicate(timeout=240)[0] for w in workers]
    for worker, log in zip(workers, logs, strict=True):
        assert worker.returncode == 0, log
        problems = [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line
                    or "Traceback" in line or "prepared statement" in line]
        assert problems == [], "\n".join(problems)
    assert count(engine, app.Job, app.Job.state == "finished") == 600
    assert sum(log.count(" noop attempt 1/5 ") for log in logs) == 600  # each job ran once, first time
    engine.dispose()


@pytest.mark.slow
def test_without_the_setting_pgbouncer_breaks_prepared_statements(bouncer: tuple[str, str]) -> None:
    """The failure the setting prevents is real on this set-up (so the test above proves the fix)."""
    through, direct = bouncer
    engine = enqueue_noops(direct, 200)
    # Make the mismatch certain rather than likely: open every server connection of the pool first, so a
    # client's consecutive transactions go round the four of them (server_round_robin) and a statement
    # prepared in one transaction is missing from the server the next one lands on.
    assert warm_server_connections(through, 4) == 4
    workers = start_workers(through, 1)
    logs = [w.communicate(timeout=240)[0] for w in workers]
    assert any("prepared statement" in log for log in logs), "\n".join(logs)[-3000:]
    engine.dispose()


def warm_server_connections(url: str, servers: int) -> int:
    """Hold ``servers`` transactions open at once through PgBouncer; return how many server backends served them."""
    engine = create_engine(url, pool_size=servers, max_overflow=0)
    connections = [engine.connect() for _ in range(servers)]
    try:
        return len({conn.execute(text("SELECT pg_backend_pid()")).scalar_one() for conn in connections})
    finally:
        for conn in connections:
            conn.close()
        engine.dispose()


def test_prepare_threshold_in_the_url_is_checked(tmp_path: Path) -> None:
    from tests.conftest import run_cli
    from tests.test_cli import assert_clean_error, clean_env

    bad = run_cli("jobs", "list", "--app", "tests.app:queue", "--url",
                  "postgresql+psycopg://u@127.0.0.1:1/db?prepare_threshold=sometimes", env=clean_env())
    assert_clean_error(bad, 2, "prepare_threshold='sometimes' must be none")
    other = run_cli("jobs", "list", "--app", "tests.app:queue", "--url",
                    "postgresql+psycopg2://u@127.0.0.1:1/db?prepare_threshold=none", env=clean_env())
    assert_clean_error(other, 2, "prepare_threshold is a setting of psycopg 3")
