"""The ``sqla-jobs`` command.

Every command that touches a database takes ``--url`` (or ``SQLA_JOBS_URL``);
those that need your models and handlers take ``--app module:attr`` (or
``SQLA_JOBS_APP``) naming your ``JobQueue``. The current directory is on the
import path, as with ``python -m``.

Exit status: 0 success, 1 the command ran and found a problem (unreachable
database, failing health check), 2 bad usage or configuration. Errors are
one readable line, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Engine, create_engine, make_url, select
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError
from sqlalchemy.orm import Session

from .cli_migrations import add_migrations_parser
from .errors import ConfigError, SqlaJobsError
from .queue import JobQueue
from .worker import Worker

__all__ = ["main"]

log = logging.getLogger("sqla_jobs")


def load_app(spec: str | None) -> JobQueue[Any, Any]:
    """Import ``module:attr`` and check it is a JobQueue."""
    if not spec:
        raise ConfigError("no app given: pass --app module:attr (or set SQLA_JOBS_APP) naming your JobQueue")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--app {spec!r} must look like 'package.module:queue'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"--app {spec!r}: cannot import {module_name!r} ({exc}); run from your project's directory "
            "or add it to PYTHONPATH"
        ) from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"--app {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, JobQueue):
        raise ConfigError(f"--app {spec!r} is a {type(obj).__name__}, not a sqla_jobs.JobQueue")
    return obj


def make_engine(raw: str | None) -> Engine:
    """An engine for ``--url``, with the driver sqla-jobs ships for PostgreSQL."""
    if not raw:
        raise ConfigError("no database given: pass --url (or set SQLA_JOBS_URL), e.g. sqlite:///jobs.db")
    try:
        url: URL = make_url(raw)
    except ArgumentError:
        raise ConfigError(
            f"--url {raw!r} is not a database URL; expected e.g. postgresql+psycopg://user@host/db "
            "or sqlite:///path/to/jobs.db"
        ) from None
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")  # psycopg 3 is our dependency, psycopg2 is not
    if url.get_backend_name() not in ("postgresql", "sqlite"):
        raise ConfigError(f"--url: sqla-jobs supports PostgreSQL and SQLite, not {url.get_backend_name()!r}")
    try:
        engine = create_engine(url)
    except (NoSuchModuleError, ImportError) as exc:
        raise ConfigError(f"--url {url.render_as_string()!r}: {exc}") from None
    try:
        with engine.connect() as conn:
            conn.execute(select(1))
    except DBAPIError as exc:
        first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        raise ConnectionProblem(f"cannot reach the database at {url.render_as_string()}: {first}") from None
    return engine


class ConnectionProblem(SqlaJobsError):
    """The database did not answer."""


# -- commands ------------------------------------------------------------------


def cmd_worker(args: argparse.Namespace) -> int:
    queue = load_app(args.app)
    engine = make_engine(args.url)
    worker = Worker(
        engine,
        queue,
        concurrency=args.concurrency,
        queues=args.queues.split(",") if args.queues else None,
        lease=args.lease,
        heartbeat=args.heartbeat,
        poll_interval=args.poll_interval,
        grace=args.grace,
        listen=not args.no_listen,
    )
    return worker.run(burst=args.burst)


def cmd_create_tables(args: argparse.Namespace) -> int:
    queue = load_app(args.app)
    engine = make_engine(args.url)
    queue.create_tables(engine)
    names = ", ".join(m.__table__.fullname for m in (queue.job_model, queue.dead_model))  # type: ignore[attr-defined]
    print(f"tables ready: {names}")
    return 0


def cmd_dead_list(args: argparse.Namespace) -> int:
    queue = load_app(args.app)
    engine = make_engine(args.url)
    queue.check_schema(engine)
    dead = queue.dead_model
    stmt = select(dead).order_by(dead.failed_at.desc(), dead.id.desc()).limit(args.limit)
    if args.kind:
        stmt = stmt.where(dead.kind == args.kind)
    with Session(engine) as session:
        rows = list(session.scalars(stmt))
    if args.json:
        print(json.dumps([_dead_dict(r) for r in rows], indent=2, default=str))
        return 0
    if not rows:
        print("no dead jobs" + (f" of kind {args.kind!r}" if args.kind else ""))
        return 0
    print(f"{'id':>8}  {'kind':<24} {'attempts':>8}  {'failed at':<26} last error")
    for r in rows:
        error = (r.last_error or "").splitlines()[0] if r.last_error else ""
        print(f"{r.id:>8}  {r.kind:<24} {r.attempts:>8}  {str(r.failed_at)[:26]:<26} {error[:80]}")
    return 0


def _dead_dict(r: Any) -> dict[str, Any]:
    return {c: getattr(r, c) for c in ("id", "kind", "queue", "payload", "attempts", "max_attempts",
                                        "failed_at", "last_error", "errors")}


def cmd_dead_retry(args: argparse.Namespace) -> int:
    if not (args.ids or args.kind or args.all):
        raise ConfigError("dead retry needs job ids, --kind KIND or --all")
    queue = load_app(args.app)
    engine = make_engine(args.url)
    queue.check_schema(engine)
    with Session(engine) as session, session.begin():
        moved = queue.requeue_dead(session, ids=args.ids or None, kind=args.kind, everything=args.all)
    print(f"requeued {len(moved)} job(s)" + (f": {', '.join(map(str, moved))}" if moved else ""))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(args.db)


# -- parser --------------------------------------------------------------------


def _common(p: argparse.ArgumentParser, app: bool = True) -> None:
    p.add_argument("--url", default=os.environ.get("SQLA_JOBS_URL"),
                   help="database URL (env SQLA_JOBS_URL), e.g. postgresql+psycopg://user@host/db")
    if app:
        p.add_argument("--app", default=os.environ.get("SQLA_JOBS_APP"),
                       help="your JobQueue as module:attr (env SQLA_JOBS_APP)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sqla-jobs", description="A job queue in your SQLAlchemy database.")
    parser.add_argument("--log-level", default=os.environ.get("SQLA_JOBS_LOG_LEVEL", "INFO"),
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("worker", help="claim and run jobs until stopped")
    _common(p)
    p.add_argument("--concurrency", type=int, default=4, help="handler threads (default 4)")
    p.add_argument("--burst", action="store_true", help="run every due job, then exit 0")
    p.add_argument("--queues", help="comma-separated queue names to take jobs from (default: all)")
    p.add_argument("--lease", type=float, default=60.0, help="seconds a claim lasts without a heartbeat")
    p.add_argument("--heartbeat", type=float, default=None, help="seconds between heartbeats (default lease/3)")
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between polls when idle")
    p.add_argument("--grace", type=float, default=30.0, help="seconds running jobs get to finish on SIGTERM")
    p.add_argument("--no-listen", action="store_true", help="poll only (e.g. behind PgBouncer)")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("create-tables", help="create the job tables (for apps without alembic)")
    _common(p)
    p.set_defaults(func=cmd_create_tables)

    dead = sub.add_parser("dead", help="inspect and requeue dead-lettered jobs")
    dsub = dead.add_subparsers(dest="dead_command", required=True, metavar="COMMAND")
    p = dsub.add_parser("list", help="list dead jobs, newest first")
    _common(p)
    p.add_argument("--kind")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_dead_list)
    p = dsub.add_parser("retry", help="move dead jobs back to the queue (attempts reset)")
    _common(p)
    p.add_argument("ids", nargs="*", type=int, metavar="ID")
    p.add_argument("--kind")
    p.add_argument("--all", action="store_true")
    p.set_defaults(func=cmd_dead_retry)

    add_migrations_parser(sub, _common)

    p = sub.add_parser("demo", help="run a self-contained demo on a SQLite file (no server needed)")
    p.add_argument("--db", default="sqla-jobs-demo.db", help="SQLite file to create (default sqla-jobs-demo.db)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ConnectionProblem as exc:
        print(f"sqla-jobs: {exc}", file=sys.stderr)
        return 1
    except SqlaJobsError as exc:
        print(f"sqla-jobs: {exc}", file=sys.stderr)
        return 2
    except DBAPIError as exc:
        first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        print(f"sqla-jobs: database error: {first}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
