"""The admin commands of ``sqla-jobs``: create-tables, stats, jobs, dead, prune, health.

Their options are defined with the rest of the parser in ``sqla_jobs.cli``;
here is what each does (docs/reference/cli.md, docs/howto/operations.md).
A ``--kind`` that no handler of the app has and no row of the table carries
is an error that lists the kinds that exist: a typo must not look like an
empty result.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import time
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from .._app import JobQueue
from .._bootstrap import load_app, make_engine
from .._durations import format_duration, parse_duration
from .._neighbourhood import Neighbour, Neighbourhood, SequencePlace, neighbourhood, policy_text, sequence_place
from .._stats import stats_tables
from ..drivers._transactions import OpenTransaction
from ..errors import ConfigError, ConnectionProblem, NotFound, SchemaError
from .durable import print_steps, steps_json
from .terminal import print_table

__all__ = [
    "cmd_create_tables",
    "cmd_dead_list",
    "cmd_dead_purge",
    "cmd_dead_retry",
    "cmd_dead_show",
    "cmd_health",
    "cmd_jobs_cancel",
    "cmd_jobs_list",
    "cmd_jobs_retry",
    "cmd_jobs_show",
    "cmd_prune",
    "cmd_stats",
]


def _open(args: argparse.Namespace) -> tuple[JobQueue[Any, Any], Engine]:
    queue = load_app(args.app)
    engine = make_engine(args.url)
    queue.check_schema(engine)
    return queue, engine


def _check_kind(queue: JobQueue[Any, Any], engine: Engine, kind: str | None, *, dead: bool) -> None:
    """ConfigError when ``kind`` is neither a handler of the app nor in the table: it can match nothing.

    A kind the table holds but the app no longer handles (a removed handler's jobs) is still valid.
    """
    if kind is None or kind in queue.handlers:
        return
    model = queue.dead_model if dead else queue.job_model
    table = model.__table__.fullname
    with engine.connect() as conn:
        present = queue.driver(conn).distinct(conn, "kind", dead=dead)
    if kind in present:
        return
    known = sorted(queue.handlers)
    close = difflib.get_close_matches(kind, [*known, *present], n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(
        f"--kind {kind!r} matches nothing: the app has no handler of that kind and table {table!r} holds "
        f"no job of it; {hint}the app's kinds: {', '.join(known) or '(none)'}; "
        f"kinds in {table}: {', '.join(present) or '(none: the table is empty)'}"
    )


def _row_dict(row: Any) -> dict[str, Any]:
    return dict(row._mapping)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _short_json(value: Any, width: int = 30) -> str:
    """A progress value on one table cell: its compact JSON, cut to ``width``."""
    if value is None:
        return ""
    text = json.dumps(value, separators=(",", ":"), default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def _cut(more: bool, limit: int, filters: str) -> str:
    """The title's note when ``--limit`` cut the list: more match than it shows."""
    return f" (only the first {limit}: more match; raise --limit or narrow with {filters})" if more else ""


def _first_line(text: str | None, width: int = 80) -> str:
    return (text or "").splitlines()[0][:width] if text else ""


def cmd_create_tables(args: argparse.Namespace) -> int:
    queue = load_app(args.app)
    engine = make_engine(args.url, create=True)
    queue.create_tables(engine, partitioned=args.partitioned)
    names = ", ".join(m.__table__.fullname for m in (queue.job_model, queue.dead_model))  # type: ignore[attr-defined]
    print(f"tables ready: {names}")
    return 0


def cmd_dead_list(args: argparse.Namespace) -> int:
    queue, engine = _open(args)
    _check_kind(queue, engine, args.kind, dead=True)
    since = parse_duration(args.since) if args.since else None
    with Session(engine) as session:
        rows = queue.list_dead(session, kind=args.kind, since=since, limit=args.limit + 1)
    rows, more = rows[: args.limit], len(rows) > args.limit
    if args.json:
        _print_json([_dead_dict(r) for r in rows])
        return 0
    if not rows:
        print("no dead jobs" + (f" of kind {args.kind!r}" if args.kind else ""))
        return 0
    print_table(
        f"{len(rows)} dead job(s), latest failure first{_cut(more, args.limit, '--kind or --since')}",
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
    _check_kind(queue, engine, args.kind, dead=True)
    with Session(engine) as session, session.begin():
        moved = queue.requeue_dead(session, ids=args.ids or None, kind=args.kind, everything=args.all)
    print(f"requeued {len(moved)} job(s)" + (f": {', '.join(map(str, moved))}" if moved else ""))
    return 0


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
    _check_kind(queue, engine, args.kind, dead=False)
    with Session(engine) as session:
        rows = queue.list_jobs(session, kind=args.kind, state=args.state, queue=args.queue,
                               unique_key=args.unique_key, sequence_key=args.sequence_key,
                               limit=args.limit + 1)
    rows, more = rows[: args.limit], len(rows) > args.limit
    if args.json:
        _print_json([_row_dict(r) for r in rows])
        return 0
    if not rows:
        hint = ""
        if args.queue is not None:  # queue names are free-form: an empty one is no error, but may be a typo
            with engine.connect() as conn:
                names = queue.driver(conn).distinct(conn, "queue")
            if args.queue not in names:
                hint = f" (no job is in queue {args.queue!r}; queues in the table: {', '.join(names) or '(none)'})"
        print("no jobs match" + hint)
        return 0
    # The progress column only when a listed job has one: most kinds never set it, and the table stays narrow.
    progress = any(r.progress is not None for r in rows)
    sequenced = any(r.sequence_key is not None for r in rows)  # likewise the sequence column (sqla_jobs._sequence)
    fair = any(r.fair_key is not None for r in rows)  # likewise a fair queue's key (sqla_jobs._fair)
    print_table(
        f"{len(rows)} job(s), newest first{_cut(more, args.limit, '--state, --kind or --queue')}",
        ["id", "kind", "queue", *(["fair key"] if fair else []), "state", *(["sequence"] if sequenced else []),
         "attempts", "run at", *(["progress"] if progress else []), "last error"],
        [[str(r.id), r.kind, r.queue, *([r.fair_key or ""] if fair else []), r.state,
          *([r.sequence_key or ""] if sequenced else []), f"{r.attempts}/{r.max_attempts}", str(r.run_at)[:19],
          *([_short_json(r.progress)] if progress else []), _first_line(r.last_error, 60)] for r in rows],
    )
    return 0


#: Upstreams and dependents `jobs show` prints (each); --json gives all of them.
SHOWN_NEIGHBOURS = 50


def _neighbours(queue: JobQueue[Any, Any], session: Session, job_id: int, as_json: bool) -> Neighbourhood:
    conn = session.connection()
    return neighbourhood(queue.driver(conn), conn, job_id, limit=None if as_json else SHOWN_NEIGHBOURS)


def _show(row: Any, state: str, as_json: bool, hood: Neighbourhood, steps: list[Any],
          batch: Any = None, place: SequencePlace | None = None) -> None:
    data = _row_dict(row)
    data.setdefault("state", state)
    if as_json:
        _print_json({**data, "upstreams": [n.to_dict() for n in hood.upstreams],
                     "dependents": [n.to_dict() for n in hood.dependents], "batch": batch and batch.id,
                     "steps": steps_json(steps), "sequence": place and place.to_dict()})
        return
    errors = data.pop("errors", None) or []
    payload = data.pop("payload", None)
    # JSON documents, printed as JSON after the plain columns (a dead job has neither of the last two).
    documents = {"payload": payload, **{k: data.pop(k) for k in ("progress", "result") if k in data}}
    width = max(len(k) for k in [*data, *documents])
    for key, value in data.items():
        if key == "last_error" and value and "\n" in str(value):
            value = str(value).splitlines()[0] + " …"
        print(f"{key:<{width}}  {'' if value is None else value}")
    for key, value in documents.items():
        shown = "" if value is None and key != "payload" else json.dumps(value, indent=2, default=str)
        print(f"{key:<{width}}  {shown}")
    print(f"errors ({len(errors)}):" if errors else "errors: none")
    for entry in errors:  # an entry without an attempt is an event between attempts: a requeue
        what = "" if entry.get("attempt") is None else f"attempt {entry.get('attempt')} "
        print(f"  {what}at {entry.get('at')}: {entry.get('error')}")
    print_steps(steps)
    if batch is not None:  # a member's or a callback's (sqla_jobs._batch)
        label = f" ({batch.label})" if batch.label else ""
        print(f"batch {batch.id}{label}: `sqla-jobs batches show {batch.id}` for its counts")
    if place is not None:
        print(place.text())
    if hood:
        _show_graph(data, state, hood)


def _show_graph(data: dict[str, Any], state: str, hood: Neighbourhood) -> None:
    """The job's place in its graph, after its fields: what it waits for, its upstreams and dependents."""
    if state == "blocked":
        print(f"blocked: waits for {data['waiting_for']} of its {hood.upstream_total} upstream(s) to finish")
        print(f"  on_upstream_failure {policy_text(data.get('on_upstream_failure'))}")
    for title, shown, more in (("upstreams", hood.upstreams, hood.more_upstreams),
                               ("dependents", hood.dependents, hood.more_dependents)):
        if not shown:
            continue
        order = "in depends_on order" if title == "upstreams" else "by id"
        print(f"{title} ({len(shown) + more}, {order}):")
        for line in _neighbour_lines(shown):
            print(f"  {line}")
        if more:
            print(f"  … and {more} more (--json lists them all)")
    waiting = [str(n.id) for n in hood.dependents if n.state == "blocked" and n.ended is None]
    if state == "dead" and waiting:
        print(f"dependent(s) {', '.join(waiting)} wait for it: requeue it with `sqla-jobs dead retry {data['id']}`")


def _neighbour_lines(neighbours: list[Neighbour]) -> list[str]:
    columns = [[str(n.id), n.shown_state, n.kind or "", n.note] for n in neighbours]
    widths = [max(len(row[i]) for row in columns) for i in range(4)]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in columns]


def cmd_jobs_show(args: argparse.Namespace) -> int:
    queue, engine = _open(args)
    with Session(engine) as session:
        row = queue.get_job(session, args.id)
        if row is None:
            row = queue.get_dead(session, args.id)
            if row is None:
                raise NotFound(f"no job with id {args.id}")
        hood = _neighbours(queue, session, args.id, args.json)
        steps = queue.job_steps(session, args.id)
        conn = session.connection()
        batch = queue.driver(conn).batch_of(conn, args.id) if hood else None
        place = sequence_place(queue.driver(conn), conn, args.id, row.sequence_key, getattr(row, "state", "dead"))
    _show(row, getattr(row, "state", "dead"), args.json, hood, steps, batch, place)
    return 0


def cmd_jobs_cancel(args: argparse.Namespace) -> int:
    queue, engine = _open(args)
    with Session(engine) as session, session.begin():
        result = queue.cancel(session, args.id)
    if result == "cancelled":
        print(f"job {args.id} cancelled: it will not run")
    else:
        print(f"job {args.id} is running: cancel requested. Its worker tells the handler at its next heartbeat "
              "(at once on PostgreSQL) "
              "(current_job().cancelled is set; an async handler gets CancelledError), and from then on the job "
              "ends cancelled however the handler stops, with no retry and no result kept. A handler that "
              "ignores it runs to its end (a worker never kills a thread) and the job still ends cancelled; "
              "a run that succeeds before the request reaches it stays finished.")
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
        hood = _neighbours(queue, session, args.id, args.json)
        steps = queue.job_steps(session, args.id)
    _show(row, "dead", args.json, hood, steps)
    return 0


def cmd_dead_purge(args: argparse.Namespace) -> int:
    queue, engine = _open(args)
    _check_kind(queue, engine, args.kind, dead=True)
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
    open_limit = None if args.max_transaction_age is None else parse_duration(args.max_transaction_age)
    try:
        queue, engine = _open(args)
        stats = queue.stats(engine, run_times=False)
        oldest = None if open_limit is None else _oldest_transaction(queue, engine)
    except (ConnectionProblem, SchemaError) as exc:
        print(f"UNHEALTHY: {exc}")
        return 1
    except DBAPIError as exc:
        print(f"UNHEALTHY: database error: {str(exc.orig or exc).strip().splitlines()[0]}")
        return 1
    age = stats.oldest_pending_age
    summary = (f"{stats.ready} ready, {stats.scheduled} scheduled, {stats.running} running, {stats.blocked} blocked, "
               f"{stats.dead_total} dead")
    if age is not None and age > limit:
        print(f"UNHEALTHY: the oldest pending job has waited {format_duration(age)} "
              f"(limit {format_duration(limit)}); {summary}")
        return 1
    if open_limit is not None and oldest is not None and oldest.seconds > open_limit:
        print(f"UNHEALTHY: a transaction has been open for {format_duration(oldest.seconds)} (limit "
              f"{format_duration(open_limit)}): {oldest.session}. While it is, the database cleans up no old "
              f"row version of the jobs table and claims slow down; end it ({oldest.end_it}) or find what "
              f"left it open; {summary}")
        return 1
    opened = "" if open_limit is None else (
        f"; oldest open transaction {format_duration(oldest.seconds if oldest else 0.0)} "
        f"(limit {format_duration(open_limit)})")
    print(f"OK: oldest pending job waited {format_duration(age or 0.0)} (limit {format_duration(limit)}){opened}; "
          f"{summary}")
    return 0


def _oldest_transaction(queue: JobQueue[Any, Any], engine: Engine) -> OpenTransaction | None:
    with engine.connect() as conn:
        driver = queue.driver(conn)
        if not driver.keeps_old_versions:
            raise ConfigError(f"--max-transaction-age: {driver.label} keeps no old row versions for an open "
                              f"transaction to hold back; leave the option out for a {driver.label} database")
        return driver.oldest_transaction(conn)
