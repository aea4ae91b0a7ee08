"""The relay's database connections cut while it works, on PostgreSQL and the real brokers.

On PostgreSQL the relay finishes each acknowledged batch on a second connection
while the next claim runs on its hot one (``RelayStore.finish_and_claim``).
Here the server terminates both, again and again, in the middle of a run: every
job still arrives, none is left behind or dead, and none spent more than its
one attempt (a claim whose finish failed is handed back uncounted; an
acknowledged job whose finish failed is finished by the retry).
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from sqlalchemy import create_engine, text

from sqla_jobs.relay import Relay, RelayCounts
from tests.conftest import PG_URL, Database
from tests.relay_app import queue

from .brokers import BrokerSpace
from .test_relay_faults import ROUTES, check_every_job_arrived, counts, enqueue

pytestmark = pytest.mark.slow


def test_every_job_arrives_while_the_server_cuts_the_relays_connections(relay_pg: Database,
                                                                       space: BrokerSpace) -> None:
    jobs = enqueue(relay_pg, 5000)
    name = f"relay-cut-{uuid.uuid4().hex[:8]}"  # picks out this relay's connections on a shared server
    engine = create_engine(relay_pg.url, connect_args={"application_name": name})
    relay = Relay(engine, queue, space.target(ROUTES), batch=100, lease=4, confirm_timeout=2)
    done: list[RelayCounts] = []
    runner = threading.Thread(target=lambda: done.append(relay.run()), daemon=True)
    admin = create_engine(PG_URL)
    cuts, last_cut = 0, 0
    try:
        runner.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (finished := counts(relay_pg).get("finished", 0)) < len(jobs):
            # A cut every 500 jobs finished, 5 at most: each costs the relay a database retry pause.
            if cuts < 5 and finished >= last_cut + 500:
                with admin.begin() as conn:
                    if conn.execute(text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                         "WHERE application_name = :name"), {"name": name}).scalar_one():
                        cuts, last_cut = cuts + 1, finished
            time.sleep(0.02)
        # A claim the server committed just before it cut the connection never reached the relay: those
        # jobs come back when their lease (4 s) runs out; the loop above waits for them too.
    finally:
        relay.stop()
        runner.join(30)
        engine.dispose()
        admin.dispose()

    assert cuts >= 3, f"the server cut the relay's connections only {cuts} time(s): the test proved nothing"
    assert counts(relay_pg) == {"finished": len(jobs), "dead": 0}
    with relay_pg.engine.connect() as conn:
        assert conn.execute(text("SELECT max(attempts) FROM relay_jobs")).scalar_one() == 1
    check_every_job_arrived(space, jobs)
