"""The checks of a job's fields, shared by ``Job(...)``'s validators, its flush and ``enqueue_many`` (internal).

Each returns the value to store (a naive ``run_at`` becomes UTC) or raises
``InvalidJob`` naming the field, so a bad job fails before its transaction commits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from . import _payload
from ._fair import check_fair_key
from ._typed import as_payload
from ._unique import DEFAULT_UNIQUE_STATES, check_key, check_on_duplicate, check_states
from .drivers import MAX_SEQUENCE_KEY_LENGTH
from .errors import InvalidJob

__all__ = [
    "MAX_KIND_LENGTH", "MAX_QUEUE_LENGTH", "MAX_SEQUENCE_KEY_LENGTH", "add_enqueue_check", "check_row",
    "check_sequence_key", "enqueue_checks", "int_field", "sequence_fields", "text_field", "unique_fields", "utc",
]

MAX_KIND_LENGTH = 255
MAX_QUEUE_LENGTH = 64
#: What a sequenced job may do when the job before it fails (``sqla_jobs._sequence``); None is the first.
SEQUENCE_POLICIES = ("hold", "run")
_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1  # the range of the INTEGER columns on every backend


def utc(name: str, value: datetime | None) -> datetime | None:
    """Naive datetimes are taken as UTC; aware ones are converted to UTC."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidJob(f"Job.{name} must be a datetime, not {type(value).__name__}")
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)



def check_row(model: type[Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """Validate one ``enqueue_many`` item like ``Job(**row)`` would; the payload comes back as JSON text."""
    unknown = set(row) - _ROW_FIELDS
    if unknown:
        raise InvalidJob(f"enqueue_many: unknown field(s) {', '.join(sorted(unknown))}; allowed: "
                         f"{', '.join(sorted(_ROW_FIELDS))}")
    if "kind" not in row:
        raise InvalidJob("Job.kind is required: the name of the handler that runs the job")
    checked = {
        "kind": text_field("kind", row["kind"], MAX_KIND_LENGTH),
        "queue": text_field("queue", row.get("queue", "default"), MAX_QUEUE_LENGTH),
        "payload": _payload.encode(as_payload(row.get("payload", {})), model.max_payload_bytes),
        "priority": int_field("priority", row.get("priority", 0)),
        "max_attempts": int_field("max_attempts", row.get("max_attempts", 5), 1),
        "run_at": utc("run_at", row.get("run_at")),
        **unique_fields(row.get("unique_key"), row.get("unique_states")),
    }
    if "on_duplicate" in row:  # what a held key does (sqla_jobs._unique.ON_DUPLICATE): keyed items only
        if checked["unique_key"] is None:
            raise InvalidJob("on_duplicate was given without a unique_key: it says what a held key does; "
                             "set unique_key too, or drop it")
        checked["on_duplicate"] = check_on_duplicate(row["on_duplicate"], checked["run_at"])
    checked.update(sequence_fields(row.get("sequence_key"), row.get("on_upstream_failure"), checked["unique_key"]))
    if row.get("fair_key") is not None:  # its turn in a fair queue (sqla_jobs._fair)
        checked["fair_key"] = check_fair_key(row["fair_key"])
    return checked


_ROW_FIELDS = {"kind", "queue", "payload", "priority", "max_attempts", "run_at", "unique_key", "unique_states",
               "on_duplicate", "sequence_key", "on_upstream_failure", "fair_key"}


def check_sequence_key(value: Any) -> str | None:
    return None if value is None else text_field("sequence_key", value, MAX_SEQUENCE_KEY_LENGTH)


def sequence_fields(key: Any, policy: Any, unique_key: str | None, depends_on: Any = ()) -> dict[str, Any]:
    """A sequenced job's fields checked together (``sqla_jobs._sequence``): the key, and what it does when the job
    before it is dead-lettered, ``hold`` (None) or ``run``; none of them when ``key`` is None."""
    key = check_sequence_key(key)
    if key is None:
        if policy is not None and not depends_on:
            raise InvalidJob("on_upstream_failure was given without a sequence_key (or depends_on): it says what a "
                             "job does when the job it waits for fails; set sequence_key, or drop it")
        return {}
    if policy not in (None, *SEQUENCE_POLICIES):
        raise InvalidJob(f"a job with a sequence_key takes on_upstream_failure 'hold' (None: the default: wait for "
                         f"a dead-lettered predecessor) or 'run' (skip it), got {policy!r}")
    if unique_key is not None:
        raise InvalidJob("a job with a sequence_key cannot have a unique_key yet (a job waiting its turn would not "
                         "hold its key); give the key to a job outside the sequence")
    if depends_on:
        raise InvalidJob("a job with a sequence_key cannot have depends_on yet: its place in the sequence is its "
                         "one dependency")
    return {"sequence_key": key, "on_upstream_failure": policy or "hold"}


def unique_fields(key: Any, states: Any) -> dict[str, Any]:
    """``unique_key`` and ``unique_states`` checked together: states without a key would do nothing."""
    if key is None:
        if states is not None:
            raise InvalidJob("Job.unique_states was given without a unique_key: set unique_key too, or drop it")
        return {"unique_key": None, "unique_states": None}
    return {"unique_key": check_key(key),
            "unique_states": check_states(DEFAULT_UNIQUE_STATES if states is None else states)}


def text_field(name: str, value: Any, max_length: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidJob(f"Job.{name} must be a non-empty string, got {value!r}")
    if "\x00" in value:  # PostgreSQL text cannot hold NUL: it would fail at flush with a driver error
        raise InvalidJob(f"Job.{name} contains \\u0000, which PostgreSQL text columns reject, got {value!r}")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: the driver could not send it
            raise InvalidJob(f"Job.{name} is not valid Unicode (it has a lone surrogate), got {value!r}") from None
    if len(value) > max_length:
        raise InvalidJob(f"Job.{name} is {len(value)} characters, over the limit of {max_length}")
    return value


def int_field(name: str, value: Any, minimum: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidJob(f"Job.{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise InvalidJob(f"Job.{name} must be at least {minimum}, got {value}")
    if not _INT_MIN <= value <= _INT_MAX:  # an INTEGER column: PostgreSQL would fail the flush with a DataError
        raise InvalidJob(f"Job.{name} must fit in 32 bits ({_INT_MIN} to {_INT_MAX}), got {value}")
    return value


#: The enqueue-time checks of each model: every ``JobQueue(model, ...)`` adds its public
#: ``check_job`` here, and the flush of a new row calls those of its class and its bases.
#: Kept here rather than as an attribute on the user's model class.
_ENQUEUE_CHECKS: dict[type[Any], list[Callable[[Any], None]]] = {}


#: Each model's checks gathered along its MRO, once: the flush of every new row reads them.
_CHECKS_BY_MODEL: dict[type[Any], tuple[Callable[[Any], None], ...]] = {}


def add_enqueue_check(model: type[Any], check: Callable[[Any], None]) -> None:
    """Have ``check(job)`` called for every new ``model`` row (and rows of its subclasses) before its INSERT."""
    _ENQUEUE_CHECKS.setdefault(model, []).append(check)
    _CHECKS_BY_MODEL.clear()  # a subclass's gathered list may now miss this check


def enqueue_checks(model: type[Any]) -> tuple[Callable[[Any], None], ...]:
    checks = _CHECKS_BY_MODEL.get(model)
    if checks is None:
        checks = _CHECKS_BY_MODEL[model] = tuple(
            check for cls in model.__mro__ for check in _ENQUEUE_CHECKS.get(cls, ()))
    return checks
