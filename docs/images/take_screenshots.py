"""Take the dashboard screenshots of docs/howto/dashboard.md (run by hand; needs chromium and chromium-driver).

A small shop app on a scratch SQLite file: a worker drains a varying load of
four kinds (one flaky, one that always fails) for ``--seconds`` while a sample
is written every two seconds, so the charts have a history; then headless
Chromium opens each page and saves ``dashboard-*.png`` next to this file::

    python docs/images/take_screenshots.py [--seconds 90]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.orm import DeclarativeBase, Session

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from sqla_jobs import Backoff, DeadJobMixin, JobMixin, JobQueue, Worker  # noqa: E402
from sqla_jobs.web import dashboard, record_sample  # noqa: E402
from tests.browser import new_browser, serve  # noqa: E402

HERE = Path(__file__).resolve().parent


class Base(DeclarativeBase):
    pass


class Job(JobMixin, Base):
    __tablename__ = "jobs"


class DeadJob(DeadJobMixin, Base):
    __tablename__ = "dead_jobs"


queue: JobQueue[Job, DeadJob] = JobQueue(Job, DeadJob, backoff=Backoff(base=1.0, jitter=0.0))


@queue.handler("send_email")
def send_email(payload: dict[str, Any]) -> None:
    time.sleep(random.uniform(0.02, 0.08))


@queue.handler("resize_image")
def resize_image(payload: dict[str, Any]) -> None:
    time.sleep(random.uniform(0.1, 0.4))


@queue.handler("charge_card")
def charge_card(payload: dict[str, Any]) -> None:
    time.sleep(random.uniform(0.05, 0.15))
    if random.random() < 0.3:
        raise ConnectionError("payments gateway: 503 Service Unavailable")


@queue.handler("sync_crm")
def sync_crm(payload: dict[str, Any]) -> None:
    raise ConnectionError(f"crm.example.com refused the update of contact {payload['contact']}")


def load(engine: Any, seconds: float) -> None:
    """Enqueue a wave of work every second: quiet, a burst, quiet again, so the charts have a shape."""
    started = time.monotonic()
    n = 0
    while (elapsed := time.monotonic() - started) < seconds:
        wave = 40 if seconds * 0.3 < elapsed < seconds * 0.6 else 6
        with Session(engine) as session, session.begin():
            for _ in range(wave):
                n += 1
                kind = random.choices(["send_email", "resize_image", "charge_card", "sync_crm"], [6, 3, 2, 0.3])[0]
                payload = {"order": 1000 + n, "contact": f"c-{n}", "to": f"customer{n}@example.com"}
                queue.enqueue(session, kind, payload, max_attempts=3 if kind != "sync_crm" else 2)
        time.sleep(1.0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=90.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = create_engine(f"sqlite:///{tmp}/shop.db")
        queue.create_tables(engine)
        app = dashboard(engine, queue, actions=True, token="screenshot-token-0123456789", refresh=2.0,
                        sample_interval=2.0, title="shop · sqla-jobs")
        worker = Worker(engine, queue, concurrency=3, poll_interval=0.2)
        threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True).start()
        loader = threading.Thread(target=load, args=(engine, args.seconds), daemon=True)
        loader.start()
        while loader.is_alive():
            record_sample(engine, queue, interval=2.0)
            time.sleep(2.0)
        with serve(app) as url:
            browser = new_browser(1400, 1100)
            try:
                shots = {"overview": "/", "jobs": "/jobs", "dead": "/dead"}
                for name, path in shots.items():
                    browser.get(url + path)
                    time.sleep(2.5)  # let the charts draw
                    browser.save_screenshot(str(HERE / f"dashboard-{name}.png"))
                with Session(engine) as session:
                    dead = queue.list_dead(session, limit=1)
                if dead:
                    browser.get(f"{url}/jobs/{dead[0].id}")
                    time.sleep(1.0)
                    browser.save_screenshot(str(HERE / "dashboard-job.png"))
            finally:
                browser.quit()
        worker.stop()
    print("saved", ", ".join(sorted(p.name for p in HERE.glob("dashboard-*.png"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
