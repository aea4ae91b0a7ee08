"""``sqla-jobs demo``: the whole life of a job queue on a SQLite file, no server needed.

It is also a small example app: ``sqla-jobs worker --url sqlite:///sqla-jobs-demo.db
--app sqla_jobs.demo:queue`` runs these handlers against the demo database.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sqlalchemy import String, create_engine, func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from ._app import JobQueue
from ._backoff import Backoff
from ._context import current_job
from ._models import DeadJobMixin, JobMixin
from .errors import ConfigError
from .worker.worker import Worker


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))


class Job(JobMixin, Base):
    __tablename__ = "jobs"


class DeadJob(DeadJobMixin, Base):
    __tablename__ = "dead_jobs"


# Retries come at once here so the demo finishes in a second; real apps keep the default minutes.
queue: JobQueue[Job, DeadJob] = JobQueue(Job, DeadJob, backoff=Backoff(base=0.0, jitter=0.0))
sent: list[str] = []


@queue.handler("send_email")
def send_email(payload: dict[str, Any]) -> None:
    sent.append(payload["to"])


@queue.handler("render_report")
def render_report(payload: dict[str, Any]) -> None:
    # Fails on the first attempt (a flaky dependency) and succeeds on the second.
    if current_job().attempt == 1:
        raise ConnectionError("report service timed out")


@queue.handler("push_to_crm")
def push_to_crm(payload: dict[str, Any]) -> None:
    raise PermissionError(f"CRM rejected customer {payload['customer']!r}: API key revoked")


def _check_path(path: str) -> None:
    """ConfigError naming ``--db`` and what to do when the demo cannot create its SQLite file there."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"--db {path}: that is a folder; give a file name, e.g. --db {os.path.join(path, 'demo.db')}")
    if not os.path.isdir(folder):
        raise ConfigError(f"--db {path}: the folder {folder} does not exist; create it or give a path in an "
                          "existing folder")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"--db {path}: cannot write in {folder}; give a path in a folder you can write to")


def main(path: str) -> int:
    _check_path(path)
    if os.path.exists(path):
        os.remove(path)
    engine = create_engine(f"sqlite:///{path}")
    try:
        Base.metadata.create_all(engine)
    except OperationalError as exc:
        raise ConfigError(f"--db {path}: cannot create the SQLite file there ({str(exc.orig).strip()}); "
                          "give a path in a folder you can write to") from None
    print(f"Created {path} with tables orders, jobs, dead_jobs.\n")

    # One request: the order and its follow-up work commit together.
    with Session(engine) as session, session.begin():
        session.add(Order(customer="Ada"))
        for to in ("ada@example.com", "sales@example.com", "audit@example.com"):
            session.add(Job(kind="send_email", payload={"to": to}))
        session.add(Job(kind="render_report", payload={"month": "2026-11"}))
        session.add(Job(kind="push_to_crm", payload={"customer": "Ada"}, max_attempts=3))
    # Another request that fails: its job never existed.
    try:
        with Session(engine) as session, session.begin():
            session.add(Job(kind="send_email", payload={"to": "ghost@example.com"}))
            raise RuntimeError("request failed")
    except RuntimeError:
        pass
    print("Enqueued 5 jobs with an order; a rolled-back request's job was discarded.\n")

    logging.getLogger("sqla_jobs").setLevel(logging.INFO)
    Worker(engine, queue, concurrency=2, poll_interval=0.05).run(burst=True, install_signals=False)

    with Session(engine) as session:
        finished = session.scalar(select(func.count()).select_from(Job).where(Job.state == "finished"))
        dead = list(session.scalars(select(DeadJob)))
    print(f"\nFinished jobs: {finished}; e-mails sent to: {', '.join(sent)}")
    for job in dead:
        print(f"Dead-lettered: job {job.id} {job.kind} after {job.attempts} attempts: {job.last_error}")
    print(f"\nRequeue it with: sqla-jobs dead retry {dead[0].id if dead else 'ID'} "
          f"--url sqlite:///{path} --app sqla_jobs.demo:queue")
    return 0
