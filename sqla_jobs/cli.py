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
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from ._bootstrap import load_app, make_engine
from ._cli_migrations import add_migrations_parser
from ._durations import format_duration, parse_duration
from ._models import STATES
from ._process import WorkerProcess, run_worker_process
from ._signals import stop_signals
from ._stats import stats_tables
from ._supervisor import supervise
from ._tables import print_table
from ._worker_config import WorkerConfig
from .errors import ConfigError, ConnectionProblem, NotFound, SchemaError, SqlaJobsError
from .queue import JobQueue

__all__ = ["main"]

log = logging.getLogger("sqla_jobs")


# -- commands ------------------------------------------------------------------


def cmd_worker(args: argparse.Namespace) -> int:
    stop_signals()  # first: a SIGTERM/SIGINT while starting is a graceful stop, not a kill
    if args.processes < 1:
        raise ConfigError("--processes must be at least 1")
    config = WorkerConfig(  # checked before connecting, so an error is about the option
        concurrency=args.concurrency,
        queues=tuple(args.queues.split(",")) if args.queues else None,
        lease=args.lease,
        heartbeat=args.heartbeat,
        poll_interval=args.poll_interval,
        grace=args.grace,
        listen=not args.no_listen,
        name=args.name,
        prune_after=parse_duration(args.prune_finished_older_than) if args.prune_finished_older_than else None,
    )
    spec = WorkerProcess(args.app, args.url, config, burst=args.burst, metrics_port=args.metrics_port,
                         metrics_addr=args.metrics_addr, log_level=args.log_level)
    if args.processes == 1:
        return run_worker_process(spec)
    queue = load_app(args.app)
    engine = make_engine(args.url, pool_size=config.pool_size)
    queue.check_schema(engine)
    engine.dispose()
    child = replace(spec, url=engine.url.render_as_string(hide_password=False))
    return supervise(child, args.processes, queue, engine, args.name)


def _open(args: argparse.Namespace) -> tuple[JobQueue[Any, Any], Engine]:
    queue = load_app(args.app)
    engine = make_engine(args.url)
    queue.check_schema(engine)
    return queue, engine


def _row_dict(row: Any) -> dict[str, Any]:
    return dict(row._mapping)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _first_line(text: str | None, width: int = 80) -> str:
    return (text or "").splitlines()[0][:width] if text else ""


def cmd_create_tables(args: argparse.Namespace) -> int:
    queue = load_app(args.app)
    engine = make_engine(args.url)
    queue.create_tables(engine)
    names = ", ".join(m.__table__.fullname for m in (queue.job_model, queue.dead_model))  # type: ignore[attr-defined]
    print(f"tables ready: {names}")
    return 0


def cmd_dead_list(args: argparse.Namespace) -> int:
    queue, engine = _open(args)
    since = parse_duration(args.since) if args.since else None
    with Session(engine) as session:
        rows = queue.list_dead(session, kind=args.kind, since=since, limit=args.limit)
    if args.json:
        _print_json([_dead_dict(r) for r in rows])
        return 0
    if not rows:
        print("no dead jobs" + (f" of kind {args.kind!r}" if args.kind else ""))
        return 0
    print_table(
        f"{len(rows)} dead job(s), latest failure first",
        ["id", "kind", "queue", "attempts", "failed at", "last error"],
        [[str(r.id), r.kind, r.queue, str(r.attempts), str(r.failed_at)[:19], _first_line(r.last_error, 80)]
         for r in rows],
    )
    return 0


def _dead_dict(r: Any) -> dict[str, Any]:
    return {c: r._mapping[c] for c in ("id", "kind", "queue", "payload", "attempts", "max_attempts",
                                        "failed_at", "last_error", "errors")}


def cmd_dead_retry(args: argparse.Namespace) -> int:
    if not (args.ids or args.kind or args.all):
        raise ConfigError("dead retry needs job ids, --kind KIND or --all")
    queue, engine = _open(args)
    with Session(engine) as session, session.begin():
        moved = queue.requeue_dead(session, ids=args.ids or None, kind=args.kind, everything=args.all)
    print(f"requeued {len(moved)} job(s)" + (f": {', '.join(map(str, moved))}" if moved else ""))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ._bench import run_bench

    return run_bench(args)


# -- stats, jobs, dead-letter admin, prune, health (docs/howto/operations.md) ----------


def cmd_stats(args: argparse.Namespace) -> int:
    queue, engine = _open(args)
    window = parse_duration(args.window)
    while True:
        stats = queue.stats(engine, window=window)
        if args.json:
            print(json.dumps(stats.to_dict()), flush=True)
        else:
            if args.watch is not None and sys.stdout.isatty():
                print("\033[2J\033[H", end="")  # clear the screen between refreshes
            for title, headers, rows in stats_tables(stats):
                print_table(title, headers, rows)
            sys.stdout.flush()
        if args.watch is None:
            return 0
        time.sleep(args.watch)


def cmd_jobs_list(args: argparse.Namespace) -> int:
    queue, engine = _open(args)
    with Session(engine) as session:
        rows = queue.list_jobs(session, kind=args.kind, state=args.state, queue=args.queue, limit=args.limit)
    if args.json:
        _print_json([_row_dict(r) for r in rows])
        return 0
    if not rows:
        print("no jobs match")
        return 0
    print_table(
        f"{len(rows)} job(s), newest first",
        ["id", "kind", "queue", "state", "attempts", "run at", "last error"],
        [[str(r.id), r.kind, r.queue, r.state, f"{r.attempts}/{r.max_attempts}", str(r.run_at)[:19],
          _first_line(r.last_error, 60)] for r in rows],
    )
    return 0


def _show(row: Any, state: str, as_json: bool) -> None:
    data = _row_dict(row)
    data.setdefault("state", state)
    if as_json:
        _print_json(data)
        return
    errors = data.pop("errors", None) or []
    payload = data.pop("payload", None)
    width = max(len(k) for k in data)
    for key, value in data.items():
        if key == "last_error" and value and "\n" in str(value):
            value = str(value).splitlines()[0] + " …"
        print(f"{key:<{width}}  {'' if value is None else value}")
    print(f"{'payload':<{width}}  {json.dumps(payload, indent=2, default=str)}")
    print(f"errors ({len(errors)}):" if errors else "errors: none")
    for entry in errors:
        print(f"  attempt {entry.get('attempt')} at {entry.get('at')}: {entry.get('error')}")


def cmd_jobs_show(args: argparse.Namespace) -> int:
    queue, engine = _open(args)
    with Session(engine) as session:
        row = queue.get_job(session, args.id)
        if row is None:
            row = queue.get_dead(session, args.id)
            if row is None:
                raise NotFound(f"no job with id {args.id}")
            _show(row, "dead", args.json)
            return 0
    _show(row, row.state, args.json)
    return 0


def cmd_jobs_cancel(args: argparse.Namespace) -> int:
    queue, engine = _open(args)
    with Session(engine) as session, session.begin():
        result = queue.cancel(session, args.id)
    if result == "cancelled":
        print(f"job {args.id} cancelled: it will not run")
    else:
        print(f"job {args.id} is running: cancellation recorded; it ends cancelled unless this run succeeds")
    return 0


def cmd_jobs_retry(args: argparse.Namespace) -> int:
    queue, engine = _open(args)
    with Session(engine) as session, session.begin():
        queue.retry_now(session, args.id)
    print(f"job {args.id} is due now")
    return 0


def cmd_dead_show(args: argparse.Namespace) -> int:
    queue, engine = _open(args)
    with Session(engine) as session:
        row = queue.get_dead(session, args.id)
        if row is None:
            alive = queue.get_job(session, args.id)
            hint = f": it is in the jobs table ({alive.state}); see `sqla-jobs jobs show {args.id}`" if alive else ""
            raise NotFound(f"no dead job with id {args.id}{hint}")
    _show(row, "dead", args.json)
    return 0


def cmd_dead_purge(args: argparse.Namespace) -> int:
    queue, engine = _open(args)
    older_than = parse_duration(args.older_than)
    with Session(engine) as session, session.begin():
        count = queue.purge_dead(session, older_than=older_than, kind=args.kind)
    print(f"purged {count} dead job(s) that failed more than {format_duration(older_than)} ago")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    queue, engine = _open(args)
    older_than = parse_duration(args.finished_older_than)
    count = queue.prune(engine, older_than=older_than, batch_size=args.batch_size)
    print(f"pruned {count} finished or cancelled job(s) older than {format_duration(older_than)}")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    limit = parse_duration(args.max_oldest_age)
    try:
        queue, engine = _open(args)
        stats = queue.stats(engine, run_times=False)
    except (ConnectionProblem, SchemaError) as exc:
        print(f"UNHEALTHY: {exc}")
        return 1
    except DBAPIError as exc:
        print(f"UNHEALTHY: database error: {str(exc.orig or exc).strip().splitlines()[0]}")
        return 1
    age = stats.oldest_pending_age
    summary = f"{stats.ready} ready, {stats.scheduled} scheduled, {stats.running} running, {stats.dead_total} dead"
    if age is not None and age > limit:
        print(f"UNHEALTHY: the oldest pending job has waited {format_duration(age)} "
              f"(limit {format_duration(limit)}); {summary}")
        return 1
    print(f"OK: oldest pending job waited {format_duration(age or 0.0)} (limit {format_duration(limit)}); {summary}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(args.db)


# -- parser --------------------------------------------------------------------


def _positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            value = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {raw}")
        return value

    return parse


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
    p.add_argument("--processes", type=int, default=1,
                   help="worker processes, each with --concurrency threads (default 1)")
    p.add_argument("--name", default=None,
                   help="worker name shown in locked_by and logs; {pid} becomes the process id "
                        "(default HOST:PID:RANDOM; with --processes, each gets NAME:PID:RANDOM)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (needs sqla-jobs[prometheus])")
    p.add_argument("--metrics-addr", default="0.0.0.0", help="address for --metrics-port (default 0.0.0.0)")
    p.add_argument("--prune-finished-older-than", metavar="AGE",
                   help="also delete finished/cancelled jobs older than AGE (e.g. 7d); one worker at a time")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("create-tables", help="create the job tables (for apps without alembic)")
    _common(p)
    p.set_defaults(func=cmd_create_tables)

    dead = sub.add_parser("dead", help="inspect and requeue dead-lettered jobs")
    dsub = dead.add_subparsers(dest="dead_command", required=True, metavar="COMMAND")
    p = dsub.add_parser("list", help="list dead jobs, newest first")
    _common(p)
    p.add_argument("--kind")
    p.add_argument("--since", metavar="AGE", help="only jobs that failed within AGE (e.g. 1h, 2d)")
    p.add_argument("--limit", type=_positive(int), default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_dead_list)
    p = dsub.add_parser("show", help="one dead job: payload and every error")
    _common(p)
    p.add_argument("id", type=int, metavar="ID")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_dead_show)
    p = dsub.add_parser("purge", help="delete dead jobs that failed before a given age")
    _common(p)
    p.add_argument("--older-than", required=True, metavar="AGE", help="e.g. 30d, 12h, 15m, 90s")
    p.add_argument("--kind")
    p.set_defaults(func=cmd_dead_purge)
    p = dsub.add_parser("retry", help="move dead jobs back to the queue (attempts reset)")
    _common(p)
    p.add_argument("ids", nargs="*", type=int, metavar="ID")
    p.add_argument("--kind")
    p.add_argument("--all", action="store_true")
    p.set_defaults(func=cmd_dead_retry)

    p = sub.add_parser("bench", help="measure enqueue, drain and pickup latency on a scratch schema or file")
    _common(p, app=False)
    p.add_argument("--jobs", type=int, default=10_000, help="jobs per measurement (default 10000)")
    p.add_argument("--concurrency", type=int, default=64, help="threads per worker process (default 64)")
    p.add_argument("--processes", type=int, default=2, help="worker processes for the drain (default 2)")
    p.add_argument("--batch-size", type=int, default=100, help="most jobs one claim takes (default 100)")
    p.add_argument("--runs", type=int, default=3, help="repeat and report medians (default 3)")
    p.add_argument("--latency-samples", type=int, default=200)
    p.add_argument("--finished-rows", type=int, default=0, help="pre-fill with this many finished jobs")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("stats", help="queue length, oldest pending age, dead letters, run times")
    _common(p)
    p.add_argument("--window", default="1h", metavar="AGE", help="run-time and throughput window (default 1h)")
    p.add_argument("--json", action="store_true", help="one JSON object (one per refresh with --watch)")
    p.add_argument("--watch", type=_positive(float), nargs="?", const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C")
    p.set_defaults(func=cmd_stats)

    jobs = sub.add_parser("jobs", help="list, inspect, cancel and retry jobs")
    jsub = jobs.add_subparsers(dest="jobs_command", required=True, metavar="COMMAND")
    p = jsub.add_parser("list", help="jobs, newest first")
    _common(p)
    p.add_argument("--kind")
    p.add_argument("--state", choices=STATES)
    p.add_argument("--queue")
    p.add_argument("--limit", type=_positive(int), default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_jobs_list)
    p = jsub.add_parser("show", help="every field of one job, its payload and error history")
    _common(p)
    p.add_argument("id", type=int, metavar="ID")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_jobs_show)
    p = jsub.add_parser("cancel", help="a pending job never runs; a running one is cancelled at its end")
    _common(p)
    p.add_argument("id", type=int, metavar="ID")
    p.set_defaults(func=cmd_jobs_cancel)
    p = jsub.add_parser("retry", help="make a pending (scheduled) job due now")
    _common(p)
    p.add_argument("id", type=int, metavar="ID")
    p.set_defaults(func=cmd_jobs_retry)

    p = sub.add_parser("prune", help="delete old finished and cancelled jobs, in small batches")
    _common(p)
    p.add_argument("--finished-older-than", required=True, metavar="AGE", help="e.g. 7d")
    p.add_argument("--batch-size", type=_positive(int), default=1000, help="rows per transaction (default 1000)")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("health", help="exit 0 if healthy, 1 with a reason if not (for probes and cron)")
    _common(p)
    p.add_argument("--max-oldest-age", required=True, metavar="AGE",
                   help="unhealthy when a due job has waited longer (e.g. 15m)")
    p.set_defaults(func=cmd_health)

    add_migrations_parser(sub, _common)

    p = sub.add_parser("demo", help="run a self-contained demo on a SQLite file (no server needed)")
    p.add_argument("--db", default="sqla-jobs-demo.db", help="SQLite file to create (default sqla-jobs-demo.db)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
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
