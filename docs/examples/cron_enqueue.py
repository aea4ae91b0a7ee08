# cron_enqueue.py
"""Run from cron: enqueue one report job per customer, in one transaction."""

import sys

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from cron_jobs import Base, queue

engine = create_engine(sys.argv[1])
Base.metadata.create_all(engine)  # in production: your migrations
customers = ["acme", "globex", "initech"]
with Session(engine) as session, session.begin():
    count = queue.enqueue_many(session, [{"kind": "nightly_report", "payload": {"customer": c}} for c in customers])
print(f"enqueued {count} report jobs")
