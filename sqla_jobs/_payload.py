"""Payload validation and encoding (internal).

A payload is accepted only if it comes back from the database as the handler
expects: PostgreSQL ``jsonb`` and SQLite's JSON text both store it, and the
rules are the intersection of what both keep (docs/howto/enqueue.md lists them).

The check is one iterative walk, so no nesting can raise ``RecursionError``.
On the ORM path the payload is encoded once per job: ``Job(...)`` walks it and
bounds its encoded size without encoding it; at flush ``encode`` walks it again
(it may have changed in place) and encodes it, and ``PayloadType`` sends that
very text instead of encoding the dict a second time.
"""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Iterator
from datetime import date, datetime, time
from decimal import Decimal
from enum import Enum
from typing import Any
from uuid import UUID

from sqlalchemy import JSON
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

from .errors import InvalidJob

__all__ = [
    "MAX_PAYLOAD_BYTES", "MAX_PAYLOAD_DEPTH", "MAX_PROGRESS_BYTES", "MAX_RESULT_BYTES", "PayloadType", "check",
    "encode", "encode_value",
]

#: Largest payload accepted, in bytes of its JSON encoding. Override per model
#: with a ``max_payload_bytes`` class attribute. Big data belongs in your own
#: tables; pass its key in the payload.
MAX_PAYLOAD_BYTES = 1_048_576
#: Deepest nesting accepted: the payload object is level 1, ``{"a": [1]}`` is 2.
#: Far deeper than real documents, yet far from Python's recursion limit (1000),
#: which every recursive reader on the way (json, copy.deepcopy, validators,
#: the handler's own code, often called deep inside a framework) must stay under.
MAX_PAYLOAD_DEPTH = 64
#: Largest handler result, in bytes of its JSON encoding (``max_result_bytes`` on the model overrides it):
#: it stays in the row until the job is pruned.
MAX_RESULT_BYTES = 65_536
#: Largest progress value (``max_progress_bytes`` on the model): it is written about once a second.
MAX_PROGRESS_BYTES = 4_096
#: Integers outside 64 bits are refused: SQLite's JSON functions turn them
#: into floats, and most JSON readers outside Python cannot hold them exactly.
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1

_Frame = tuple[Iterator[tuple[Any, Any]], bool, Any]


def _path(keys: list[Any], last: Any = None, has_last: bool = False) -> str:
    return "payload" + "".join(f"[{k!r}]" for k in (*keys, last)[: len(keys) + has_last])


def _string_size(value: str, keys: list[Any], key: Any, what: str) -> int:
    """Check one string (a value or a key); return a bound on its encoded size."""
    if "\x00" in value:
        raise InvalidJob(f"Job.{_path(keys, key, True)}{what} contains \\u0000, which PostgreSQL jsonb rejects")
    if value.isascii():
        # JSON escapes only '"', '\\' (2 bytes) and control characters (6 bytes).
        return 2 + (2 * len(value) if value.isprintable() else 6 * len(value))
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate such as "\ud800", e.g. from bad decoding
        raise InvalidJob(
            f"Job.{_path(keys, key, True)}{what} contains the lone surrogate {value[exc.start]!r}, which is not "
            "valid Unicode and PostgreSQL jsonb rejects; decode your input with errors='replace'"
        ) from None
    return 2 + 12 * len(value)  # a character outside the BMP is two \\uXXXX escapes


def _unstorable(value: Any, keys: list[Any], key: Any) -> InvalidJob:
    name = type(value).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    if isinstance(value, tuple):
        advice = "JSON has only lists, so it would come back as a list: pass list(value)"
    elif isinstance(value, (datetime, date, time)):
        advice = "pass value.isoformat() and parse it in the handler"
    elif isinstance(value, Decimal):
        advice = "pass str(value) to keep every digit (or float(value) if rounding is fine)"
    elif isinstance(value, (UUID, Enum)):
        advice = "pass str(value)" if isinstance(value, UUID) else "pass value.value"
    elif isinstance(value, (bytes, bytearray)):
        advice = "pass text (value.decode()) or base64 of it"
    elif isinstance(value, (set, frozenset)):
        advice = "pass a list, e.g. sorted(value)"
    else:
        advice = "pass plain values (str, int, float, bool, None, lists and dicts), e.g. an id"
    return InvalidJob(f"Job.{_path(keys, key, True)} is {article} {name}, which JSON cannot store; {advice}")


def _scan(payload: Any) -> int:
    """Check every item of ``payload`` without recursion; return a bound on its encoded size."""
    if not isinstance(payload, dict):
        raise InvalidJob(f"Job.payload must be a dict (a JSON object), not {type(payload).__name__}")
    size = 2
    keys: list[Any] = []  # the path from the payload to the container being scanned
    frames: list[_Frame] = [(iter(payload.items()), True, payload)]
    isfinite = math.isfinite
    while frames:
        items, is_dict, _container = frames[-1]
        for key, value in items:
            if is_dict:
                if type(key) is not str and not isinstance(key, str):
                    raise InvalidJob(
                        f"Job.{_path(keys)} has the non-string key {key!r} of type {type(key).__name__}; JSON keys are "
                        "strings, and the handler would get a different key back: pass str(key)"
                    )
                size += 2 + _string_size(key, keys, key, " key")
            else:
                size += 1
            kind = type(value)
            if kind is str:
                size += _string_size(value, keys, key, "")
            elif kind is int:
                if not _INT_MIN <= value <= _INT_MAX:
                    raise _too_big(value, keys, key)
                size += 20
            elif kind is float:
                if not isfinite(value):
                    raise InvalidJob(
                        f"Job.{_path(keys, key, True)} is {value!r}; JSON has no NaN or infinity: "
                        "use null or a string instead"
                    )
                size += 24
            elif value is None or kind is bool:
                size += 5
            elif kind is dict or kind is list or (isinstance(value, (dict, list)) and not isinstance(value, Enum)):
                if len(frames) >= MAX_PAYLOAD_DEPTH:
                    raise _too_deep(frames, value, keys, key)
                keys.append(key)
                frames.append((iter(value.items()) if isinstance(value, dict) else enumerate(value),
                               isinstance(value, dict), value))
                size += 2
                break
            else:
                size += _subclass_size(value, keys, key)
        else:
            frames.pop()
            if keys:
                keys.pop()
    return size


def _subclass_size(value: Any, keys: list[Any], key: Any) -> int:
    """Subclasses of the JSON types (a StrEnum, an IntEnum) are stored as their plain value."""
    if isinstance(value, bool):
        return 5
    if isinstance(value, str):
        return _string_size(value, keys, key, "")
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise _too_big(value, keys, key)
        return 20
    if isinstance(value, float) and not isinstance(value, Enum):
        if not math.isfinite(value):
            raise InvalidJob(f"Job.{_path(keys, key, True)} is {value!r}; JSON has no NaN or infinity")
        return 24
    raise _unstorable(value, keys, key)


def _too_big(value: int, keys: list[Any], key: Any) -> InvalidJob:
    return InvalidJob(
        f"Job.{_path(keys, key, True)} is an int of {value.bit_length()} bits, outside the 64-bit range "
        f"({_INT_MIN} to {_INT_MAX}) that JSON readers keep exact (SQLite's JSON functions turn it into a "
        "float); pass it as a string"
    )


def _too_deep(frames: list[_Frame], value: Any, keys: list[Any], key: Any) -> InvalidJob:
    if any(value is frame[2] for frame in frames):  # only looked for on this error path
        return InvalidJob(f"Job.{_path(keys, key, True)} contains itself (a circular reference); JSON cannot store it")
    return InvalidJob(
        f"Job.{_path(keys, key, True)} is nested deeper than {MAX_PAYLOAD_DEPTH} levels; flatten it or "
        "store the document in your own table and pass its key"
    )


def _too_large(size: int, limit: int) -> InvalidJob:
    return InvalidJob(
        f"Job.payload is {size} bytes of JSON, over the {limit}-byte limit; "
        "store large data in your own table and pass its key"
    )


# ensure_ascii (the default) makes characters == bytes for the size limit. One
# encoder for all: json.dumps with options builds a new one per call, which cost
# more than the encoding of a small payload.
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def _dumps(payload: dict[str, Any]) -> str:
    return _ENCODER.encode(payload)


def check(payload: Any, limit: int = MAX_PAYLOAD_BYTES) -> None:
    """Raise InvalidJob unless ``payload`` is storable; encodes it only when it may be over ``limit``."""
    if _scan(payload) > limit:
        encoded = _dumps(payload)
        if len(encoded) > limit:
            raise _too_large(len(encoded), limit)


def encode(payload: Any, limit: int = MAX_PAYLOAD_BYTES) -> str:
    """Check ``payload`` like ``check`` and return its JSON text."""
    _scan(payload)
    encoded = _dumps(payload)
    if len(encoded) > limit:
        raise _too_large(len(encoded), limit)
    return encoded


def encode_value(value: Any, limit: int, what: str) -> str:
    """Check a handler's result or progress (any JSON value, not only an object) by the payload rules.

    Returns its JSON text; raises InvalidJob naming ``what`` and the path of the bad item.
    """
    try:
        _scan({"": value})
    except InvalidJob as exc:
        raise InvalidJob(str(exc).replace("Job.payload['']", what, 1)) from None
    encoded = _dumps(value)  # type: ignore[arg-type]
    if len(encoded) > limit:
        raise InvalidJob(f"{what} is {len(encoded)} bytes of JSON, over the {limit}-byte limit; "
                         "store large data in your own table and return its key")
    return encoded


class _Encoded:
    """A payload's JSON text, made at flush, waiting for the INSERT that sends it."""

    __slots__ = ("__weakref__", "payload", "text")

    def __init__(self, payload: dict[str, Any], text: str) -> None:
        self.payload: dict[str, Any] | None = payload
        self.text: str | None = text


# id(payload) -> its text. Weak: the entry lives as long as the job object that
# holds it (see ``remember``), so a flush that fails before its INSERT leaks nothing.
_pending: weakref.WeakValueDictionary[int, _Encoded] = weakref.WeakValueDictionary()


def remember(target: Any, payload: dict[str, Any], text: str) -> None:
    """Keep ``text`` for the INSERT of ``target`` that follows in this flush."""
    entry = _Encoded(payload, text)
    target.__dict__["_sqla_jobs_encoded"] = entry  # not mapped: only keeps the entry alive
    _pending[id(payload)] = entry


def _take(value: Any) -> str | None:
    """The text made at flush for exactly this object, once (a later UPDATE encodes afresh)."""
    entry = _pending.pop(id(value), None)
    if entry is None or entry.payload is not value:
        return None
    text, entry.text, entry.payload = entry.text, None, None  # the job object need not keep them
    return text


class PayloadType(TypeDecorator[Any]):
    """JSON (``jsonb`` on PostgreSQL) that sends the text encoded at flush instead of encoding again."""

    impl = JSON
    cache_ok = True

    def __init__(self, impl: Any = None) -> None:
        super().__init__()
        if impl is not None:
            self.impl = impl

    def bind_processor(self, dialect: Dialect) -> Any:
        # dialect_impl: a variant's impl comes here unadapted (plain JSONB, not psycopg's).
        inner = self.impl_instance.dialect_impl(dialect).bind_processor(dialect)

        def process(value: Any) -> Any:
            text = _take(value) if type(value) is dict else None
            if text is not None:
                # A plain string: SQLite stores the text; psycopg sends it into
                # the "::JSONB" cast SQLAlchemy renders, where jsonb parses it.
                return text
            return inner(value) if inner is not None else value

        return process
