"""Unique jobs: the key rules, the state sets a key covers, the key helper and what ``enqueue_unique`` returns.

A job with a ``unique_key`` *holds* its key while its state is one of its
``unique_states`` (default: pending and running). The database enforces it:
the generated column ``unique_held`` is the key while the job holds it and
NULL otherwise, and a unique index on that column lets only one job hold a
key at a time (``JobMixin.job_indexes``). Nothing here reads before it
writes: ``JobQueue.enqueue_unique`` inserts and lets the index decide
(``Driver.insert_unique``: ``ON CONFLICT DO NOTHING`` or a savepoint), so a
duplicate never aborts the caller's transaction. A duplicate may then update
the holder while it is pending (``on_duplicate``: ``insert_or_update``).

The states are kept as a bitmask (``STATE_BITS``) in an INTEGER column, read
by the generated column's portable ``CASE`` expression. Every set includes
pending and running: a job only ever moves *out* of those two into finished
or cancelled, never back, so a job that lost its key can never take it again
by a state change (which would fail a worker's write with a duplicate).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sqlalchemy import Integer
from sqlalchemy.types import TypeDecorator

from .errors import InvalidJob

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from .drivers import Driver

__all__ = [
    "DEFAULT_UNIQUE_STATES",
    "HELD_KEY_SQL",
    "MAX_UNIQUE_KEY_LENGTH",
    "ON_DUPLICATE",
    "STATE_BITS",
    "Enqueued",
    "StateSet",
    "check_on_duplicate",
    "check_states",
    "insert_or_update",
    "period_key",
    "unique_key",
]

MAX_UNIQUE_KEY_LENGTH = 255
#: One bit per state a key can cover.
STATE_BITS = {"pending": 1, "running": 2, "finished": 4, "cancelled": 8}
DEFAULT_UNIQUE_STATES = ("pending", "running")
#: With a period, a key means "once per period": finished jobs of the period keep holding it.
PERIOD_UNIQUE_STATES = ("pending", "running", "finished")

#: The generated column ``unique_held``: the key while the job's state is among its unique states.
#: Plain SQL every backend reads the same (a CASE and a bitwise AND), so one migration serves all.
HELD_KEY_SQL = (
    "CASE WHEN (unique_states & (CASE state WHEN 'pending' THEN 1 WHEN 'running' THEN 2 "
    "WHEN 'finished' THEN 4 WHEN 'cancelled' THEN 8 ELSE 0 END)) <> 0 THEN unique_key END"
)


#: What a duplicate enqueue does to the pending job that holds its key: nothing (``keep``), give it the new
#: payload (``replace``), or give it the new payload and push its ``run_at`` out to the new one (``debounce``).
ON_DUPLICATE = ("keep", "replace", "debounce")


def check_on_duplicate(value: Any, run_at: datetime | None) -> str:
    """``on_duplicate`` checked with the job's ``run_at`` (a debounce needs one); InvalidJob for anything else."""
    if value not in ON_DUPLICATE:
        raise InvalidJob(f"on_duplicate must be one of {', '.join(map(repr, ON_DUPLICATE))}, got {value!r}")
    if value == "debounce" and run_at is None:
        raise InvalidJob("on_duplicate='debounce' needs run_at=: the moment the job runs unless another enqueue "
                         "pushes it out (e.g. now + 30 s)")
    return str(value)


def insert_or_update(driver: Driver, conn: Connection, row: dict[str, Any],
                     on_duplicate: str) -> tuple[int | None, bool]:
    """Insert a checked keyed row (``_fields.check_row``): ``(new id, False)``; on a held key ``(None, updated)``,
    ``updated`` saying whether ``on_duplicate`` changed the pending holder (``Driver.update_holder``)."""
    new_id = driver.insert_unique(conn, row)
    if new_id is not None or on_duplicate == "keep":
        return new_id, False
    run_at = row["run_at"] if on_duplicate == "debounce" else None
    return None, driver.update_holder(conn, row["unique_key"], row["payload"], run_at, row.get("trace_context"))


def check_states(states: Any) -> tuple[str, ...]:
    """The state names as a tuple in ``STATE_BITS`` order; InvalidJob for anything else."""
    if isinstance(states, str) or not isinstance(states, Iterable):
        raise InvalidJob(f"Job.unique_states must be a list of state names such as ('pending', 'running'), "
                         f"got {states!r}")
    names = set(states)
    unknown = sorted(str(n) for n in names - set(STATE_BITS))
    if unknown:
        raise InvalidJob(f"Job.unique_states: unknown state(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(STATE_BITS)}")
    if not {"pending", "running"} <= names:
        raise InvalidJob(
            "Job.unique_states must include 'pending' and 'running' (a job leaves them only for good, so its key "
            f"is never taken back by a state change); add 'finished' and/or 'cancelled' to keep the key longer, "
            f"got {tuple(states)!r}"
        )
    return tuple(name for name in STATE_BITS if name in names)


class StateSet(TypeDecorator[tuple[str, ...]]):
    """A tuple of state names stored as the bitmask the generated column reads."""

    impl = Integer
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> int | None:
        if value is None:
            return None
        return sum(STATE_BITS[name] for name in check_states(value))

    def process_result_value(self, value: Any, dialect: Any) -> tuple[str, ...] | None:
        if value is None:
            return None
        return tuple(name for name, bit in STATE_BITS.items() if int(value) & bit)


def check_key(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidJob(f"Job.unique_key must be a non-empty string, got {value!r}")
    if "\x00" in value:
        raise InvalidJob(f"Job.unique_key contains \\u0000, which PostgreSQL text columns reject, got {value!r}")
    if len(value) > MAX_UNIQUE_KEY_LENGTH:
        raise InvalidJob(f"Job.unique_key is {len(value)} characters, over the limit of {MAX_UNIQUE_KEY_LENGTH}: "
                         "use sqla_jobs.unique_key(...), which hashes long keys")
    return value


def unique_key(kind: str, payload: Mapping[str, Any] | None = None, fields: Sequence[str] = ()) -> str:
    """A key made of ``kind`` and the values of the chosen payload ``fields`` (all of them if none are named).

    ``unique_key("charge", {"order": 42, "note": "x"}, ["order"])`` is
    ``'charge:{"order":42}'``: two payloads that agree on those fields give the
    same key, whatever else they hold. Keys longer than the column's 255
    characters are shortened to the kind and a SHA-256 of the rest.
    """
    if not isinstance(kind, str) or not kind.strip():
        raise InvalidJob(f"unique_key: kind must be a non-empty string, got {kind!r}")
    payload = dict(payload or {})
    if isinstance(fields, str):
        raise InvalidJob(f"unique_key: fields must be a list of payload keys, got the string {fields!r}")
    missing = [f for f in fields if f not in payload]
    if missing:
        raise InvalidJob(f"unique_key: the payload has no field(s) {', '.join(map(repr, missing))}; "
                         f"it has {', '.join(map(repr, sorted(payload))) or 'none'}")
    chosen = {f: payload[f] for f in fields} if fields else payload
    try:
        body = json.dumps(chosen, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidJob(f"unique_key: the chosen payload fields are not JSON: {exc}") from None
    key = f"{kind}:{body}"
    if len(key) <= MAX_UNIQUE_KEY_LENGTH:
        return key
    return f"{kind[:150]}:sha256:{hashlib.sha256(body.encode()).hexdigest()}"


def period_key(key: str, period: float, now: datetime | None = None) -> str:
    """``key`` with the start of its period appended (``key@2026-11-30T17:00:00Z``): one job per key per period.

    Periods are counted from the Unix epoch in UTC (a period of 3600 starts on
    the hour), on the enqueuing host's clock.
    """
    if not isinstance(period, (int, float)) or isinstance(period, bool) or period <= 0:
        raise InvalidJob(f"unique period must be a number of seconds > 0, got {period!r}")
    moment = (now or datetime.now(timezone.utc)).timestamp()
    start = datetime.fromtimestamp(moment - moment % period, timezone.utc)
    stamp = start.strftime("%Y-%m-%dT%H:%M:%S") + (f".{start.microsecond:06d}" if start.microsecond else "") + "Z"
    return check_key(f"{check_key(key)}@{stamp}")


J = TypeVar("J")


@dataclass(frozen=True)
class Enqueued(Generic[J]):
    """What ``JobQueue.enqueue_unique`` did: ``job`` is the new job (``inserted``) or the one that holds the key.

    ``id`` is the job's id, readable after the session is closed (``job``'s
    attributes expire at commit unless the session says otherwise).
    ``updated``: this call gave the holder its payload (``on_duplicate="replace"``)
    or also pushed its ``run_at`` out (``"debounce"``); False when it inserted, kept
    the holder as it was, or found it already running (or ended, in its unique states).
    """

    job: J
    inserted: bool
    id: int
    updated: bool = False
