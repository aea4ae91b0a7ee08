"""Durable jobs on the command line: ``sqla-jobs events emit`` and the steps ``jobs show`` prints.

``sqla-jobs events emit KEY --data JSON`` is ``queue.emit_event`` for people: it wakes the jobs
parked in ``wait_for_event(KEY, ...)`` (docs/howto/durable.md). ``jobs show`` lists a job's
steps, sleeps and waits after its fields (``print_steps``; ``--json`` adds them as ``steps``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from .._bootstrap import load_app, make_engine
from ..errors import ConfigError

__all__ = ["add_events_parser", "cmd_events_emit", "print_steps", "steps_json"]


def add_events_parser(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    events = sub.add_parser("events", help="emit the events durable jobs wait for")
    esub = events.add_subparsers(dest="events_command", required=True, metavar="COMMAND")
    p = esub.add_parser("emit", help="emit event KEY: the jobs waiting for it run now (the first emit of a key wins)")
    common(p)
    p.add_argument("key", metavar="KEY", help="the event's key, as the handler's wait_for_event names it")
    p.add_argument("--data", default="null", metavar="JSON",
                   help="the event's data, a JSON value wait_for_event returns (default null)")
    p.set_defaults(func=cmd_events_emit)


def cmd_events_emit(args: argparse.Namespace) -> int:
    try:
        data = json.loads(args.data)
    except ValueError as exc:
        raise ConfigError(f"--data is not JSON ({exc}): quote it for the shell, e.g. --data '{{\"amount\": 42}}'")
    queue = load_app(args.app)
    engine = make_engine(args.url)
    queue.check_schema(engine)
    with Session(engine) as session, session.begin():
        woken = queue.emit_event(session, args.key, data)
    if woken is None:
        print(f"event {args.key!r} was emitted before: nothing changed (the first emit of a key wins)")
    else:
        print(f"event {args.key!r} emitted: {woken} waiting job(s) due now")
    return 0


def steps_json(rows: list[Any]) -> list[dict[str, Any]]:
    return [{"name": r.name, "value": r.value, "until": _time(r.until), "awaiting": r.awaiting,
             "started_at": _time(r.started_at), "finished_at": _time(r.finished_at)} for r in rows]


def _time(value: Any) -> str | None:
    return None if value is None else value.isoformat()


def step_status(row: Any) -> str:
    """How a step stands, in words: done, or what a parked sleep or wait waits for."""
    if row.finished_at is not None:
        return f"done {row.finished_at:%Y-%m-%d %H:%M:%S}"
    if row.awaiting is not None:
        return f"waits for event {row.awaiting!r} until {row.until:%Y-%m-%d %H:%M:%S}"
    if row.until is not None:
        return f"sleeps until {row.until:%Y-%m-%d %H:%M:%S}"
    return "started"


def print_steps(rows: list[Any]) -> None:
    """The steps after a job's fields: name, how it stands, its value (JSON, cut short)."""
    if not rows:
        return
    print(f"steps ({len(rows)}):")
    width = max(len(r.name) for r in rows)
    for r in rows:
        value = "" if r.finished_at is None else json.dumps(r.value, default=str)
        if len(value) > 60:
            value = value[:59] + "…"
        print(f"  {r.name:<{width}}  {step_status(r)}  {value}".rstrip())
