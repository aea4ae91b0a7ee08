"""Drain rate and connections by number of worker hosts (network namespaces on this machine).

::

    sudo python docs/bench/multihost.py --url postgresql+psycopg://postgres@127.0.0.1:5432/test \\
        [--hosts 1,2,4,8] [--jobs 20000] [--processes 1] [--concurrency 8] [--runs 3]

Each host is a Linux network namespace reaching PostgreSQL through its own veth
link (``tests/netns.py``, the harness of ``tests/test_multihost.py``); every host
runs ``sqla-jobs worker --processes P --concurrency C`` on the test app's no-op
kind. For each host count and run, the script enqueues ``--jobs`` jobs with
``enqueue_many`` while the hosts wait, times the drain from the commit to the
last finished job, and samples the server's connections to the scratch schema's
database. It prints medians. Run it as root (namespaces need CAP_NET_ADMIN).

All hosts share this machine's CPUs with the database, so the figures show what
more hosts cost (connections, claim contention), not what more machines gain.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests import app, netns  # noqa: E402  (the harness lives with the tests that prove it)


def drain_once(url: str, hosts: int, jobs: int, processes: int, concurrency: int) -> tuple[float, int]:
    """(jobs/s, peak connections of the database during the drain) for one run on a fresh schema."""
    schema = f"sqla_jobs_hosts_{uuid.uuid4().hex[:8]}"
    admin = create_engine(url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    scoped = make_url(url).update_query_dict({"options": f"-csearch_path={schema}"})
    engine = create_engine(scoped)
    database = make_url(url).database
    try:
        app.queue.create_tables(engine)
        app.Base.metadata.create_all(engine)
        with netns.hosts(hosts) as made:
            for host in made:
                host_url = host.url(scoped.render_as_string(hide_password=False))
                host.popen(
                    [sys.executable, "-m", "sqla_jobs.cli", "--log-level", "WARNING", "worker", "--app",
                     "tests.app:queue", "--url", host_url, "--processes", str(processes),
                     "--concurrency", str(concurrency), "--name", f"host{host.index}"],
                    env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "SQLA_JOBS_URL": host_url},
                    cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
            time.sleep(2 + hosts * processes * 0.5)  # every worker connected and listening
            peak, done = [0], threading.Event()

            def sample() -> None:
                with admin.connect() as conn:
                    while not done.is_set():
                        n = conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE datname = :d"),
                                         {"d": database}).scalar_one()
                        peak[0] = max(peak[0], int(n))
                        time.sleep(0.1)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            with Session(engine) as session, session.begin():
                app.queue.enqueue_many(session, [{"kind": "noop"}] * jobs)
            start = time.perf_counter()
            while True:
                with engine.connect() as conn:
                    left = conn.execute(select(func.count()).select_from(app.Job).where(
                        app.Job.state != "finished")).scalar_one()
                if left == 0:
                    break
                time.sleep(0.01)
            elapsed = time.perf_counter() - start
            done.set()
            sampler.join()
        return jobs / elapsed, peak[0]
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--hosts", default="1,2,4,8", help="host counts to measure, comma-separated")
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--processes", type=int, default=1, help="worker processes per host")
    parser.add_argument("--concurrency", type=int, default=8, help="threads per worker process")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    missing = netns.problem()
    if missing:
        sys.exit(f"multihost bench: {missing}")
    print(f"{'hosts':>5} {'processes':>9} {'drain jobs/s (median)':>22} {'runs':>28} {'peak connections':>17}")
    for hosts in [int(h) for h in args.hosts.split(",")]:
        results = [drain_once(args.url, hosts, args.jobs, args.processes, args.concurrency) for _ in range(args.runs)]
        rates = [r for r, _ in results]
        runs = ", ".join(f"{r:,.0f}" for r in rates)
        print(f"{hosts:>5} {hosts * args.processes:>9} {statistics.median(rates):>22,.0f} {runs:>28} "
              f"{max(c for _, c in results):>17}", flush=True)


if __name__ == "__main__":
    main()
