"""The app the relay tests run (``--app tests.relay_app:queue``): its own tables, relayed kinds only.

Separate from ``tests.app`` so registering the relayed kinds does not change the
kinds that app knows (other tests check its messages).
"""

from __future__ import annotations

from sqlalchemy.orm import DeclarativeBase

from sqla_jobs import Backoff, DeadJobMixin, JobMixin, JobQueue
from sqla_jobs.relay import relayed


class Base(DeclarativeBase):
    pass


class RelayJob(JobMixin, Base):
    __tablename__ = "relay_jobs"


class RelayDeadJob(DeadJobMixin, Base):
    __tablename__ = "relay_dead_jobs"


queue: JobQueue[RelayJob, RelayDeadJob] = JobQueue(RelayJob, RelayDeadJob, backoff=Backoff(base=0.2, jitter=0.0))
relayed(queue, "order.created", "order.paid", "no.route")
