"""Measure ``enqueue_many`` through a sync ``Session`` and through ``queue.aio`` on an ``AsyncSession``.

A manual benchmark, not a test. For each backend given, in a scratch schema (PostgreSQL), database
(MariaDB) or file (SQLite) it drops afterwards, enqueues ``--rows`` jobs in one transaction, both
ways, ``--runs`` times each, and prints the median seconds and rows per second::

    python docs/bench/async_enqueue.py [--rows 20000] [--runs 3] [--backends sqlite,postgresql,mariadb]

The async path runs the same method through ``AsyncSession.run_sync`` (COPY on PostgreSQL through
psycopg's async connection), so the two should be close; the difference is the async driver.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, delete, make_url, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from tests.app import Base, Job, queue

PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
MARIADB = "mariadb+pymysql://root@127.0.0.1:3306/test?charset=utf8mb4"
ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+psycopg", "mariadb": "mariadb+aiomysql"}


@contextmanager
def scratch(backend: str) -> Iterator[str]:
    """A sync URL to an empty place with the test app's tables, removed afterwards."""
    name = f"bench_{uuid.uuid4().hex[:10]}"
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as folder:
            yield f"sqlite:///{folder}/bench.db"
        return
    admin = create_engine(PG if backend == "postgresql" else MARIADB)
    create, drop = (f'CREATE SCHEMA "{name}"', f'DROP SCHEMA "{name}" CASCADE') if backend == "postgresql" else (
        f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4", f"DROP DATABASE `{name}`")
    with admin.begin() as conn:
        conn.execute(text(create))
    base = make_url(admin.url)
    url = (base.update_query_dict({"options": f"-csearch_path={name}"}) if backend == "postgresql"
           else base.set(database=name))
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(drop))
        admin.dispose()


def items(rows: int) -> list[dict[str, Any]]:
    return [{"kind": "noop", "payload": {"n": n, "to": f"user{n}@example.com"}} for n in range(rows)]


def clear(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        session.execute(delete(Job))


def sync_once(engine: Engine, rows: int) -> float:
    clear(engine)
    jobs = items(rows)
    start = time.perf_counter()
    with Session(engine) as session, session.begin():
        queue.enqueue_many(session, jobs)
    return time.perf_counter() - start


def async_runs(url: str, rows: int, runs: int, engine: Engine) -> list[float]:
    async def main() -> list[float]:
        async_engine = create_async_engine(url)
        took = []
        for _ in range(runs):
            clear(engine)
            jobs = items(rows)
            start = time.perf_counter()
            async with AsyncSession(async_engine) as session, session.begin():
                await queue.aio.enqueue_many(session, jobs)
            took.append(time.perf_counter() - start)
        await async_engine.dispose()
        return took

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--backends", default="sqlite,postgresql,mariadb")
    args = parser.parse_args()
    print(f"enqueue_many of {args.rows} jobs in one transaction, median of {args.runs}")
    for backend in args.backends.split(","):
        with scratch(backend) as url:
            engine = create_engine(url)
            queue.create_tables(engine)
            Base.metadata.create_all(engine)
            sync = statistics.median(sync_once(engine, args.rows) for _ in range(args.runs))
            aurl = make_url(url).set(drivername=ASYNC_DRIVERS[backend]).render_as_string(hide_password=False)
            aio = statistics.median(async_runs(aurl, args.rows, args.runs, engine))
            engine.dispose()
        print(f"{backend:>10}: sync {sync:.3f} s ({args.rows / sync:,.0f}/s)   "
              f"async {aio:.3f} s ({args.rows / aio:,.0f}/s)   async/sync time {aio / sync:.2f}")


if __name__ == "__main__":
    main()
