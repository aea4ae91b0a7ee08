"""An app with a fair queue, for worker processes (``--app tests.fair_app:queue``).

It shares tests.app's jobs tables. Queue ``fair`` is fair: a job's key is its ``fair_key``, or its payload's
``tenant`` (``key_field``), and tenant ``big`` has weight 2. Each run writes one ``fair_runs`` row with its
wall-clock start (``time.time()``: one clock for every process on the host) and its key.
"""

from __future__ import annotations

import os
import time
from typing import Any

from sqlalchemy import BigInteger, Column, Double, Integer, MetaData, String, Table, insert

from sqla_jobs import FairQueue, JobQueue, current_job
from tests import app

metadata = MetaData()
runs = Table(
    "fair_runs", metadata,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True),
    Column("job_id", BigInteger, nullable=False),
    Column("queue", String(64), nullable=False),
    Column("key", String(128), nullable=True),
    Column("pid", Integer, nullable=False),
    Column("started", Double, nullable=False),
)

# check_kinds=False: a second app on tests.app's model must not refuse tests.app's kinds elsewhere.
queue: JobQueue[app.Job, app.DeadJob] = JobQueue(
    app.Job, app.DeadJob, check_kinds=False, fair={"fair": FairQueue(weights={"big": 2}, key_field="tenant")})


# "noop": a kind tests.app knows too, so its enqueue check lets these jobs through; this app runs its own.
@queue.handler("noop")
def tenant_work(payload: dict[str, Any]) -> None:
    started = time.time()
    job = current_job()
    with app.engine().begin() as conn:
        conn.execute(insert(runs).values(job_id=job.id, queue=job.queue, key=payload.get("key"), pid=os.getpid(),
                                         started=started))
    time.sleep(payload.get("sleep", 0.0))
