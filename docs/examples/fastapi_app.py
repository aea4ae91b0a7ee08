# fastapi_app.py
"""FastAPI: a request's session enqueues in the request's transaction; a worker runs beside the app."""

import os
import threading
from collections.abc import Iterator
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel
from sqlalchemy import DateTime, String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqla_jobs import DeadJobMixin, JobMixin, JobQueue, Worker, current_job


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(200))
    confirmed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Job(JobMixin, Base):
    __tablename__ = "jobs"


class DeadJob(DeadJobMixin, Base):
    __tablename__ = "dead_jobs"


queue = JobQueue(Job, DeadJob)


@queue.handler("confirm_order", transactional=True)
def confirm_order(payload: dict) -> None:
    # Sending the e-mail would go here; the order's update commits with the job's completion.
    session = current_job().session
    session.get(Order, payload["order_id"]).confirmed_at = datetime.now(timezone.utc)


def get_session(request: Request) -> Iterator[Session]:
    """One session and one transaction per request: committed when the endpoint returns, rolled back if it raises."""
    with Session(request.app.state.engine) as session, session.begin():
        yield session


# scope="function": the commit runs when the endpoint returns, before the response is sent, so a 201
# means the order and its job are committed (the default scope would commit after sending it).
DbSession = Annotated[Session, Depends(get_session, scope="function")]


class OrderIn(BaseModel):
    email: str


def create_app(database_url: str, *, run_worker: bool = False) -> FastAPI:
    engine = create_engine(database_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        Base.metadata.create_all(engine)  # in production: your migrations
        worker = None
        if run_worker:  # small deployments: a worker thread in the web process
            worker = Worker(engine, queue, concurrency=2)
            thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
            thread.start()
        yield
        if worker is not None:
            worker.stop()  # unfinished jobs go back to pending for the next worker
            thread.join(timeout=worker.config.grace + 5)
        engine.dispose()

    app = FastAPI(lifespan=lifespan)
    app.state.engine = engine

    @app.post("/orders", status_code=201)
    def place_order(order: OrderIn, session: DbSession) -> dict:
        if "@" not in order.email:
            raise HTTPException(422, "not an e-mail address")  # the transaction rolls back: no order, no job
        row = Order(email=order.email)
        session.add(row)
        session.flush()  # the order's id, for the job's payload
        session.add(Job(kind="confirm_order", payload={"order_id": row.id}))
        return {"id": row.id}

    @app.get("/orders/{order_id}")
    def show_order(order_id: int, session: DbSession) -> dict:
        row = session.get(Order, order_id)
        if row is None:
            raise HTTPException(404, "no such order")
        return {"id": row.id, "confirmed": row.confirmed_at is not None}

    return app


app = create_app(os.environ.get("DATABASE_URL", "sqlite:///shop.db"))
