"""``sqla-jobs batches list`` and ``batches show``: batches and how their members stand (sqla_jobs._batch)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from sqlalchemy.orm import Session

from .._batch import BatchStatus
from ..errors import NotFound
from .admin import _open
from .terminal import print_table

__all__ = ["add_batch_commands", "callbacks_text", "cmd_batches_list", "cmd_batches_show"]


def add_batch_commands(sub: Any, common_options: Any, json_flag: Any, positive: Any) -> None:
    """The ``batches`` group, on the parser ``build_parser`` makes."""
    group = sub.add_parser("batches", help="batches of jobs and their callbacks (docs/howto/batches.md)")
    bsub = group.add_subparsers(dest="batches_command", required=True, metavar="COMMAND")
    p = bsub.add_parser("list", help="list batches, newest first, with their callbacks' states")
    common_options(p)
    p.add_argument("--limit", type=positive(int), default=50, help="show at most this many")
    p.add_argument("--before", type=int, metavar="ID", help="only batches with ids below ID (the next page)")
    json_flag(p, "an array of batches")
    p.set_defaults(func=cmd_batches_list)
    p = bsub.add_parser("show", help="one batch: its members' counts and its callbacks")
    common_options(p)
    p.add_argument("id", type=int, metavar="ID", help="the batch's id (as in `batches list`)")
    json_flag(p, "the batch")
    p.set_defaults(func=cmd_batches_show)


def callbacks_text(callbacks: dict[str, tuple[int, str | None]]) -> str:
    """``on_complete 12 pending, on_failure 13 blocked``: a callback no longer in the table shows ``pruned``."""
    return ", ".join(f"{name} {job_id} {state or 'pruned'}" for name, (job_id, state) in callbacks.items())


def cmd_batches_list(args: argparse.Namespace) -> int:
    queue, engine = _open(args)
    with Session(engine) as session:
        found = queue.batches(session, limit=args.limit + 1, before=args.before)
    shown, more = found[: args.limit], len(found) > args.limit
    if args.json:
        print(json.dumps([asdict(b) for b in shown], indent=2, default=str))
        return 0
    if not shown:
        print("no batches" + (f" below id {args.before}" if args.before else ""))
        return 0
    note = f" (more: `--before {shown[-1].id}` for the next page)" if more else ""
    print_table(f"{len(shown)} batch(es), newest first{note}", ["id", "label", "created", "members", "callbacks"],
                [[str(b.id), b.label or "", str(b.created_at)[:19], str(b.total), callbacks_text(b.callbacks)]
                 for b in shown])
    return 0


def cmd_batches_show(args: argparse.Namespace) -> int:
    queue, engine = _open(args)
    with Session(engine) as session:
        batch = queue.batch(session, args.id)
    if batch is None:
        raise NotFound(f"no batch with id {args.id} (never made, or pruned with its callbacks): "
                       "`sqla-jobs batches list` shows those there are")
    if args.json:
        print(json.dumps({**asdict(batch), "complete": batch.complete}, indent=2, default=str))
        return 0
    for line in describe(batch):
        print(line)
    return 0


def describe(batch: BatchStatus) -> list[str]:
    """A batch as ``batches show`` prints it."""
    ended = "every member has ended" if batch.complete else f"{batch.waiting} member(s) still to end"
    lines = [f"batch {batch.id}" + (f" ({batch.label})" if batch.label else "") + f", made {batch.created_at}",
             f"members   {batch.total}: {ended}",
             f"  finished {batch.finished}, dead {batch.dead}, cancelled {batch.cancelled}, "
             f"waiting {batch.waiting}" + (f", pruned or purged {batch.removed}" if batch.removed else ""),
             "callbacks (`sqla-jobs jobs show ID` for each):"]
    lines += [f"  {name:<12}{job_id:<10}{state or 'pruned'}" for name, (job_id, state) in batch.callbacks.items()]
    return lines
