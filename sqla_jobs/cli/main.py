"""The ``sqla-jobs`` command.

Every command that touches a database takes ``--url`` (or ``SQLA_JOBS_URL``);
those that need your models and handlers take ``--app module:attr`` (or
``SQLA_JOBS_APP``) naming your ``JobQueue``. The current directory is on the
import path, as with ``python -m``.

Exit status: 0 success, 1 the command ran and found a problem (unreachable
database, failing health check), 2 bad usage or configuration, 141 the
output's reader went away (``| head``). Errors are one readable line, never a
traceback. Here: ``main``, the parser and the worker; the admin commands are
in ``admin``, ``migrations`` in ``migrations`` (this folder).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

from sqlalchemy.exc import DBAPIError

from .. import __version__
from .._bootstrap import is_async_url, load_worker_app, make_engine, sync_twin
from .._durations import parse_duration
from .._models import STATES
from ..errors import ConfigError, ConnectionProblem, SqlaJobsError
from ..worker.config import WorkerConfig, parse_queue_options, split_queues
from ..worker.process import WorkerProcess, run_worker_process
from ..worker.signals import stop_signals
from ..worker.supervisor import supervise
from .admin import (
    cmd_create_tables,
    cmd_dead_list,
    cmd_dead_purge,
    cmd_dead_retry,
    cmd_dead_show,
    cmd_health,
    cmd_jobs_cancel,
    cmd_jobs_list,
    cmd_jobs_retry,
    cmd_jobs_show,
    cmd_prune,
    cmd_stats,
)
from .batches import add_batch_commands
from .dashboard import add_dashboard_parser
from .durable import add_events_parser
from .migrations import add_migrations_parser
from .options import Parser, common_options, iter_commands, job_id_argument, json_flag, not_negative, positive
from .relay import add_relay_parser

__all__ = ["main"]

log = logging.getLogger("sqla_jobs")
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


# -- commands ------------------------------------------------------------------


def cmd_worker(args: argparse.Namespace) -> int:
    stop_signals()  # first: a SIGTERM/SIGINT while starting is a graceful stop, not a kill
    if args.processes < 1:
        raise ConfigError("--processes must be at least 1")
    if args.queue and args.queues:
        raise ConfigError("give queues with --queue (repeatable) or --queues, not both")
    config = worker_config(args)  # checked before connecting, so an error is about the option
    asynchronous = args.use_async or is_async_url(args.url)
    spec = WorkerProcess(args.app, args.url, config, burst=args.burst, metrics_port=args.metrics_port,
                         metrics_addr=args.metrics_addr, log_level=args.log_level, asynchronous=asynchronous)
    if args.processes == 1:
        return run_worker_process(spec)
    queue = load_worker_app(args.app)
    # The supervisor hands back its children's jobs on a sync engine: the async URL's sync twin.
    engine = make_engine(sync_twin(args.url) if asynchronous else args.url, pool_size=config.pool_size)
    queue.check_schema(engine)
    engine.dispose()
    # The children get the URL as given, not the engine's: that one has lost what went into connect_args
    # (?prepare_threshold=none, without which a child behind PgBouncer prepares statements).
    return supervise(spec, args.processes, queue, engine, args.name)


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """``sqla-jobs worker``'s options as the worker's settings; an option left out has ``WorkerConfig``'s default."""
    named = parse_queue_options(args.queue) if args.queue else (args.queues.split(",") if args.queues else None)
    concurrency, names, slots = split_queues(named, args.concurrency)
    return WorkerConfig(
        concurrency=concurrency,
        queues=names,
        queue_slots=slots,
        lease=args.lease,
        heartbeat=args.heartbeat,
        poll_interval=args.poll_interval,
        grace=args.grace,
        listen=not args.no_listen,
        name=args.name,
        prune_after=(parse_duration(args.prune_finished_older_than) if args.prune_finished_older_than
                     else WorkerConfig.prune_after),
        vacuum_dead_rows=args.vacuum_dead_rows,
        leader=not args.no_leader,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from ..bench.processes import stop_on_sigterm

    stop_on_sigterm()  # a stop unwinds like an error: the workers are stopped, the scratch removed
    if args.durable:
        from ..bench.durable import run_durable

        return run_durable(args)
    if args.graphs is not None:
        from ..bench.graphs import run_graphs

        return run_graphs(args)
    if args.fair:
        from ..bench.fair import run_fair

        return run_fair(args)
    if args.soak is not None:
        from ..bench.soak import run_soak

        return run_soak(args)
    from ..bench.run import run_bench

    return run_bench(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from .. import demo

    return demo.main(args.db)


# -- parser --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="sqla-jobs", description="A job queue in your SQLAlchemy database.",
                     epilog="`sqla-jobs COMMAND --help` describes each command; docs/reference/cli.md has them all.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version of sqla-jobs and exit")
    parser.add_argument("--log-level", default=os.environ.get("SQLA_JOBS_LOG_LEVEL", "INFO"), choices=LOG_LEVELS,
                        help="how much the command logs (env SQLA_JOBS_LOG_LEVEL); also after the command")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("worker", help="claim and run jobs until stopped")
    common_options(p)
    # Each worker option's default is WorkerConfig's field (read here, never written again), and its help
    # shows it: the formatter adds "(default: ...)" to any option whose help does not name one.
    p.add_argument("--concurrency", type=int, default=None,
                   help=f"handler threads (default {WorkerConfig.concurrency}; with --queue NAME=SLOTS, "
                        "the sum of the slots)")
    p.add_argument("--burst", action="store_true", help="run every due job, then exit 0")
    p.add_argument("--queue", action="append", metavar="NAME[=SLOTS]",
                   help="a lane (a job's queue= name) to take jobs from; repeat for more; NAME=SLOTS gives the "
                        "lane SLOTS threads of its own, so a busy lane never delays another (default: every lane, "
                        "shared threads). Not the app: that is --app")
    p.add_argument("--queues", help="shorthand for --queue a --queue b: comma-separated lanes (default: all)")
    p.add_argument("--lease", type=positive(float), default=WorkerConfig.lease,
                   help="seconds a claim lasts without a heartbeat")
    p.add_argument("--heartbeat", type=positive(float), default=WorkerConfig.heartbeat,
                   help="seconds between heartbeats (default lease/3)")
    p.add_argument("--poll-interval", type=positive(float), default=WorkerConfig.poll_interval,
                   help="seconds between polls when idle")
    p.add_argument("--grace", type=not_negative, default=WorkerConfig.grace,
                   help="seconds running jobs get to finish on SIGTERM")
    p.add_argument("--no-listen", action="store_true", help="poll only (e.g. behind PgBouncer)")
    p.add_argument("--async", dest="use_async", action="store_true",
                   help="the async worker: async def handlers on one event loop, --concurrency of them at once, "
                        "plain ones on threads (default when --url names an async driver, e.g. sqlite+aiosqlite)")
    p.add_argument("--no-leader", action="store_true",
                   help="every worker reaps and prunes, instead of one elected worker (sqla_jobs.leader)")
    p.add_argument("--processes", type=int, default=1,
                   help="worker processes, each with --concurrency threads (default 1)")
    p.add_argument("--name", default=WorkerConfig.name,
                   help="worker name shown in locked_by and logs; {pid} becomes the process id "
                        "(default HOST:PID:RANDOM; with --processes, each gets NAME:PID:RANDOM)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (needs sqla-jobs[prometheus])")
    p.add_argument("--metrics-addr", default="0.0.0.0", help="address for --metrics-port (default 0.0.0.0)")
    p.add_argument("--prune-finished-older-than", metavar="AGE",
                   help="also delete finished/cancelled jobs older than AGE (e.g. 7d); one worker at a time. "
                        "0: keep no finished jobs, each deleted as it finishes (faster)")
    p.add_argument("--vacuum-dead-rows", type=positive(int), default=WorkerConfig.vacuum_dead_rows, metavar="N",
                   help="PostgreSQL: VACUUM the jobs table once it holds N dead rows (e.g. 50000), for bursts "
                        "autovacuum is too slow for; one worker at a time (default: leave it to autovacuum)")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("create-tables", help="create the job tables (for apps without alembic)")
    common_options(p)
    p.add_argument("--partitioned", action="store_true",
                   help="PostgreSQL: partition a new jobs table so finished jobs leave the hot table and "
                        "retention drops whole days (docs/howto/partitioning.md)")
    p.set_defaults(func=cmd_create_tables)

    dead = sub.add_parser("dead", help="inspect, requeue and purge dead-lettered jobs")
    dsub = dead.add_subparsers(dest="dead_command", required=True, metavar="COMMAND")
    p = dsub.add_parser("list", help="list dead jobs, latest failure first")
    common_options(p)
    p.add_argument("--kind", help="only dead jobs of this kind")
    p.add_argument("--since", metavar="AGE", help="only jobs that failed within AGE (e.g. 1h, 2d)")
    p.add_argument("--limit", type=positive(int), default=50, help="show at most this many")
    json_flag(p, "an array of dead jobs, with payloads and error histories,")
    p.set_defaults(func=cmd_dead_list)
    p = dsub.add_parser("show", help="one dead job: payload and every error")
    common_options(p)
    job_id_argument(p, "the dead job's id (as in `dead list`)")
    json_flag(p, "the dead job")
    p.set_defaults(func=cmd_dead_show)
    p = dsub.add_parser("purge", help="delete dead jobs that failed before a given age")
    common_options(p)
    p.add_argument("--older-than", required=True, metavar="AGE", help="e.g. 30d, 12h, 15m, 90s")
    p.add_argument("--kind", help="only dead jobs of this kind")
    p.set_defaults(func=cmd_dead_purge)
    p = dsub.add_parser("retry", help="move dead jobs back to the queue (attempts reset)")
    common_options(p)
    p.add_argument("ids", nargs="*", type=int, metavar="ID", help="ids of dead jobs to requeue")
    p.add_argument("--kind", help="requeue every dead job of this kind")
    p.add_argument("--all", action="store_true", help="requeue every dead job")
    p.set_defaults(func=cmd_dead_retry)

    add_batch_commands(sub, common_options, json_flag, positive)

    p = sub.add_parser("bench", help="measure enqueue, drain and pickup latency on a scratch schema or file")
    common_options(p, app=False)
    p.add_argument("--jobs", type=int, default=10_000, help="jobs per measurement (default 10000)")
    # The bench's own default, not a worker's: it measures a busy worker, which has more threads than four.
    p.add_argument("--concurrency", type=int, default=64, help="threads per worker process (default 64)")
    p.add_argument("--processes", type=int, default=2, help="worker processes for the drain (default 2)")
    p.add_argument("--batch-size", type=positive(int), default=WorkerConfig.batch_size,
                   help="most jobs one claim takes (default: --concurrency, as sqla-jobs worker does)")
    p.add_argument("--runs", type=int, default=3, help="repeat and report medians (default 3)")
    p.add_argument("--latency-samples", type=int, default=200,
                   help="jobs enqueued one at a time to measure pickup latency")
    p.add_argument("--finished-rows", type=int, default=0, help="pre-fill with this many finished jobs")
    p.add_argument("--soak", metavar="DURATION",
                   help="instead of a burst: enqueue at --rate for DURATION (e.g. 300s, 5m) while workers drain, "
                        "and report every --window")
    p.add_argument("--rate", default="1000", metavar="JOBS_PER_S",
                   help="with --soak: jobs enqueued per second, or 'max' for as fast as one producer can")
    p.add_argument("--window", default="10s", metavar="DURATION", help="with --soak: the reporting window")
    p.add_argument("--soak-prune", default="60s", metavar="AGE",
                   help="with --soak: delete finished jobs older than AGE every second, or 'none' to keep them")
    p.add_argument("--soak-vacuum", default="none", metavar="EVERY",
                   help="with --soak on PostgreSQL: VACUUM the jobs table every EVERY (e.g. 10s), for a server "
                        "whose autovacuum is off or too slow; 'none' leaves it to autovacuum")
    p.add_argument("--drain-timeout", default="120s", metavar="DURATION",
                   help="with --soak: how long the workers may take to drain what is left after DURATION")
    p.add_argument("--storage", metavar="NAME=VALUE,...",
                   help="with --soak on PostgreSQL: the jobs table's storage parameters, e.g. "
                        "autovacuum_vacuum_scale_factor=0.01,fillfactor=70")
    p.add_argument("--faults", type=int, metavar="SEED",
                   help="with --soak: a fault every 30 to 60 s (kill, SIGTERM or stall a worker process, cut the "
                        "workers' connections), drawn from SEED; the report checks every job finished once")
    p.add_argument("--fault-every", default="30-60", metavar="MIN-MAX",
                   help="with --faults: seconds between two faults, drawn between MIN and MAX (default 30-60)")
    p.add_argument("--out", default="soak-results", metavar="DIR",
                   help="with --soak: where soak.json, soak.csv and soak.png go")
    json_flag(p, "the figures")
    p.add_argument("--async", dest="use_async", action="store_true",
                   help="measure the async worker (sqla-jobs worker --async) with async def no-op handlers")
    p.add_argument("--vacuum-dead-rows", type=positive(int), default=WorkerConfig.vacuum_dead_rows, metavar="N",
                   help="the drain's workers run as `sqla-jobs worker --vacuum-dead-rows N` (PostgreSQL)")
    p.add_argument("--discard-finished", action="store_true",
                   help="the drain's workers run as `sqla-jobs worker --prune-finished-older-than 0`: each job "
                        "is deleted as it finishes")
    p.add_argument("--graphs", nargs="?", const="fan,chain,enqueue,batch", metavar="fan,chain,enqueue,batch",
                   help="instead: job graphs, each beside its peer: a 1 -> N -> 1 graph's drain and a plain one, "
                        "a chain's hop latency and a new job's pickup, --jobs enqueued with dependencies and "
                        "without, N enqueue_many'd as a batch's members and without (default with the flag: all)")
    p.add_argument("--fan-out", type=positive(int), default=100_000, metavar="N",
                   help="with --graphs: the jobs between the fan-out's root and its join, and a batch's members "
                        "(default 100000)")
    p.add_argument("--chain-length", type=positive(int), default=10_000, metavar="M",
                   help="with --graphs: the jobs of the chain (default 10000)")
    p.add_argument("--durable", action="store_true",
                   help="instead: durable jobs: a step's overhead, emit -> resume latency, --waiters parked jobs "
                        "(what they hold, and all woken by one transaction)")
    p.add_argument("--waiters", type=positive(int), default=10_000, metavar="N",
                   help="with --durable: the jobs parked each waiting for its own event (default 10000)")
    p.add_argument("--fair", action="store_true",
                   help="instead: a fair queue: tenant A's backlog of --fair-backlog jobs while tenants B..K each "
                        "enqueue a job every 100 ms: their pickup latency, A's drain rate, fair and not, and the "
                        "claim's cost with 10,000 keys")
    p.add_argument("--fair-backlog", type=positive(int), default=100_000, metavar="N",
                   help="with --fair: tenant A's pending jobs (default 100000)")
    p.add_argument("--fair-window", type=float, default=5.0, metavar="SECONDS",
                   help="with --fair: how long B..K enqueue in each scene (default 5)")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("stats", help="queue length, oldest pending age, dead letters, run times")
    common_options(p)
    p.add_argument("--window", default="1h", metavar="AGE", help="run-time and throughput window (default 1h)")
    p.add_argument("--json", action="store_true", help="one JSON object (one per refresh with --watch)")
    p.add_argument("--watch", type=positive(float), nargs="?", const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C")
    p.set_defaults(func=cmd_stats)

    jobs = sub.add_parser("jobs", help="list, inspect, cancel and retry jobs")
    jsub = jobs.add_subparsers(dest="jobs_command", required=True, metavar="COMMAND")
    p = jsub.add_parser("list", help="jobs, newest first")
    common_options(p)
    p.add_argument("--kind", help="only jobs of this kind")
    p.add_argument("--state", choices=STATES, help="only jobs in this state")
    p.add_argument("--queue", help="only jobs in this queue")
    p.add_argument("--unique-key", metavar="KEY",
                   help="only jobs with this unique key (and its periods, KEY@...; a schedule's slots: periodic:NAME)")
    p.add_argument("--sequence-key", metavar="KEY", help="only the jobs of this sequence (newest first)")
    p.add_argument("--limit", type=positive(int), default=50, help="show at most this many")
    json_flag(p, "an array of jobs")
    p.set_defaults(func=cmd_jobs_list)
    p = jsub.add_parser("show", help="every field of one job, its payload and error history")
    common_options(p)
    job_id_argument(p, "the job's id (a dead job's too)")
    json_flag(p, "the job")
    p.set_defaults(func=cmd_jobs_show)
    p = jsub.add_parser("cancel",
                        help="a pending or blocked job never runs; a running one is told to stop and ends cancelled")
    common_options(p)
    job_id_argument(p, "the id of the job to cancel")
    p.set_defaults(func=cmd_jobs_cancel)
    p = jsub.add_parser("retry", help="make a pending (scheduled) job due now")
    common_options(p)
    job_id_argument(p, "the id of the pending job")
    p.set_defaults(func=cmd_jobs_retry)

    p = sub.add_parser("prune", help="delete old finished and cancelled jobs, in small batches")
    common_options(p)
    p.add_argument("--finished-older-than", required=True, metavar="AGE", help="e.g. 7d")
    p.add_argument("--batch-size", type=positive(int), default=1000, help="rows per transaction (default 1000)")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("health", help="exit 0 if healthy, 1 with a reason if not (for probes and cron)")
    common_options(p)
    p.add_argument("--max-oldest-age", required=True, metavar="AGE",
                   help="unhealthy when a due job has waited longer (e.g. 15m)")
    p.add_argument("--max-transaction-age", metavar="AGE",
                   help="PostgreSQL, MariaDB: unhealthy when a transaction in the database has been open longer "
                        "(e.g. 10m): it keeps the jobs table's old row versions (docs/howto/operations.md)")
    p.set_defaults(func=cmd_health)

    add_migrations_parser(sub, common_options)
    add_dashboard_parser(sub, common_options)
    add_relay_parser(sub, common_options)
    add_events_parser(sub, common_options)

    p = sub.add_parser("demo", help="run a self-contained demo on a SQLite file (no server needed)")
    p.add_argument("--db", default="sqla-jobs-demo.db", help="SQLite file to create (default sqla-jobs-demo.db)")
    p.set_defaults(func=cmd_demo)

    for _path, command, summary in iter_commands(parser):
        if not command.description:  # `sqla-jobs COMMAND --help` starts with what the command does
            command.description = summary[:1].upper() + summary[1:] + "."
        if not any(isinstance(a, argparse._SubParsersAction) for a in command._actions):  # `worker --log-level X`
            command.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                                 help="how much the command logs (env SQLA_JOBS_LOG_LEVEL, default INFO)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        status = func(args)
        sys.stdout.flush()  # here, so a closed pipe is seen now and not at interpreter exit
        return status
    except BrokenPipeError:
        # The reader went away (`sqla-jobs jobs list | head`): stop quietly, like any Unix filter.
        # stdout goes to devnull so Python's flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
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

