"""An app with limits across workers, for worker processes (``--app tests.limits_app:queue``).

It shares tests.app's jobs tables; each run writes one ``limit_runs`` row with
its wall-clock start and end (``time.time()``: one clock for every process on
the host), so the test can replay exactly how many runs overlapped. A run's
handler interval lies inside the time its row was ``running``, so the replay
can only under-count what the database allowed, never invent an overlap.
Enqueue with ``queue.enqueue_many``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from sqlalchemy import BigInteger, Column, Double, Integer, MetaData, String, Table, insert

from sqla_jobs import JobQueue, current_job
from tests import app

metadata = MetaData()
runs = Table(
    "limit_runs", metadata,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True),
    Column("job_id", BigInteger, nullable=False),
    Column("kind", String(64), nullable=False),
    Column("key", String(64), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started", Double, nullable=False),
    Column("ended", Double, nullable=False),
)

#: The limits the tests check.
CAPPED = 3
PER_CUSTOMER = 1
RATE = (10, 0.5)  # 20 starts a second

# check_kinds=False: a second app on tests.app's model adds its own enqueue check to that model, which
# would refuse tests.app's kinds in every test that runs after this module is imported.
queue: JobQueue[app.Job, app.DeadJob] = JobQueue(app.Job, app.DeadJob, check_kinds=False)


def _timed(payload: dict[str, Any]) -> None:
    started = time.time()
    time.sleep(payload.get("sleep", 0.0))
    ended = time.time()
    job = current_job()
    with app.engine().begin() as conn:
        conn.execute(insert(runs).values(job_id=job.id, kind=job.kind, key=str(payload.get("customer", "")),
                                         pid=os.getpid(), started=started, ended=ended))


#: LIMITS_APP_PLAIN=1: "capped"'s is the only limit, a plain one (no key, no rate), so the worker claims in its
#: backend's faster way where it has one (``Driver.finish_and_claim_capped``; PostgreSQL: one pipeline).
PLAIN_ONLY = os.environ.get("LIMITS_APP_PLAIN") == "1"

queue.handler("capped", limit=CAPPED)(_timed)
queue.handler("per_customer", **({} if PLAIN_ONLY else {"limit": PER_CUSTOMER, "limit_key": "customer"}))(_timed)
queue.handler("paced", **({} if PLAIN_ONLY else {"rate": RATE}))(_timed)
queue.handler("free")(_timed)
