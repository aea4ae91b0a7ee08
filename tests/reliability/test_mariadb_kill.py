"""MariaDB: the worker's connections killed on the server (``KILL <id>``) mid-run.

The PostgreSQL counterpart is ``test_outage.py`` (``pg_terminate_backend``).
The handlers reach the database over the Unix socket and the worker over TCP,
so the processlist tells the worker's connections apart and only those die.
"""

from __future__ import annotations

import pytest
from sqlalchemy import make_url

from tests.conftest import Database

from .conftest import Workers
from .harness import all_settled, check_invariants, effects, enqueue, job, kill_tcp_connections, wait_for

pytestmark = pytest.mark.slow

SOCKET = "/run/mysqld/mysqld.sock"


def test_connection_killed_between_claim_and_finish(mariadb: Database, workers: Workers) -> None:
    handler_url = make_url(mariadb.url).update_query_dict({"unix_socket": SOCKET})
    # As in test_outage: one thread, a long lease and heartbeat, so the first statement to meet the
    # killed connection is the job's finish, which must be kept and retried, not lost or run again.
    worker = workers(mariadb.url, handler_url=handler_url.render_as_string(hide_password=False),
                     lease=60, heartbeat=20, concurrency=1)
    [job_id] = enqueue(mariadb.engine, "record", {"sleep": 1.5})
    wait_for(lambda: effects(mariadb.engine, job_id, "start"), 30, "the handler to start")
    assert kill_tcp_connections(str(mariadb.schema)) >= 1
    mariadb.engine.dispose()  # the test's own pooled connections were TCP too
    wait_for(lambda: all_settled(mariadb.engine, [job_id]), 20, "the worker to reconnect and record the finish")
    row = job(mariadb.engine, job_id)
    assert (row.state, row.attempts) == ("finished", 1), "finished by the same worker, no retry"
    assert "database error" in worker.log()

    more = enqueue(mariadb.engine, "record", n=5)
    wait_for(lambda: all_settled(mariadb.engine, more), 20, "the worker to carry on")
    assert worker.stop() == 0
    check_invariants(mariadb.engine, [job_id, *more], workers.logs())
