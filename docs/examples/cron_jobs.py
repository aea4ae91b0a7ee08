# cron_jobs.py
"""A plain script's queue: no web framework, the tables and the handler."""

from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_jobs import DeadJobMixin, JobMixin, JobQueue, current_job


class Base(DeclarativeBase):
    pass


class Report(Base):
    __tablename__ = "reports"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))


class Job(JobMixin, Base):
    __tablename__ = "jobs"


class DeadJob(DeadJobMixin, Base):
    __tablename__ = "dead_jobs"


queue = JobQueue(Job, DeadJob)


@queue.handler("nightly_report", transactional=True)
def nightly_report(payload: dict) -> None:
    current_job().session.add(Report(customer=payload["customer"]))
