# flask_app.py
"""Flask with Flask-SQLAlchemy: the view's db.session commits the order and its job together."""

import os
from datetime import datetime, timezone

from flask import Flask, abort, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import DateTime, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_jobs import DeadJobMixin, JobMixin, JobQueue, current_job


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


class Order(db.Model):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(200))
    confirmed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Job(JobMixin, db.Model):
    __tablename__ = "jobs"


class DeadJob(DeadJobMixin, db.Model):
    __tablename__ = "dead_jobs"


queue = JobQueue(Job, DeadJob)


@queue.handler("confirm_order", transactional=True)
def confirm_order(payload: dict) -> None:
    # Runs in the worker, outside any Flask app context: use the job's own session, not db.session.
    session = current_job().session
    session.get(Order, payload["order_id"]).confirmed_at = datetime.now(timezone.utc)


def create_app(database_url: str) -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = database_url
    db.init_app(app)
    with app.app_context():
        db.create_all()  # in production: your migrations (Flask-Migrate is alembic)

    @app.post("/orders")
    def place_order():
        email = (request.get_json(silent=True) or {}).get("email", "")
        if "@" not in email:
            abort(422, "not an e-mail address")
        order = Order(email=email)
        db.session.add(order)
        db.session.flush()  # the order's id, for the job's payload
        db.session.add(Job(kind="confirm_order", payload={"order_id": order.id}))
        db.session.commit()  # the order and its job, or neither
        return {"id": order.id}, 201

    @app.get("/orders/<int:order_id>")
    def show_order(order_id: int):
        order = db.get_or_404(Order, order_id)
        return {"id": order.id, "confirmed": order.confirmed_at is not None}

    return app


# `flask --app flask_app run`. Flask-SQLAlchemy keeps a relative SQLite file in the app's instance
# folder, so the worker (no Flask app) names that path; a server URL is the same for both:
#   sqla-jobs worker --url sqlite:///instance/shop.db --app flask_app:queue
app = create_app(os.environ.get("DATABASE_URL", "sqlite:///shop.db"))
