"""PostgreSQL: the claimed jobs' payloads read for less than psycopg's own ``jsonb`` loader.

psycopg reads a ``jsonb`` value with ``json.loads`` on its bytes: an encoding sniff of the bytes, a
decode, a whitespace scan on each side of the value and the parse. PostgreSQL prints a ``jsonb``
value with nothing around it, so the parse alone (``JSONDecoder.raw_decode`` of the text) gives the
same object; a value with more after it is read by ``json.loads`` itself, error and all. On a
claim of no-op jobs the payload was most of the CPU psycopg spent loading a claimed row
(2.8 µs a row against 1.3 µs: docs/performance.md, "The worker's own CPU per job").

Only the claim's cursor reads through it (``faster_payloads``), and only while the connection reads
``jsonb`` with psycopg's loader and ``json.loads``: a ``json_deserializer`` given to the engine, or
psycopg's ``set_json_loads``, is kept. Imported where psycopg is in use (``claim.py``), never by a
SQLite or MariaDB process.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from psycopg import pq
from psycopg.adapt import Buffer, Loader
from psycopg.postgres import types

__all__ = ["faster_payloads"]

_JSONB = types["jsonb"].oid
_decode = json.JSONDecoder().raw_decode  # what json.loads uses once the text is found: the default decoder's parse

C = TypeVar("C")


class PayloadLoader(Loader):
    """``jsonb`` as ``json.loads`` reads it: the same object, or the same error."""

    def load(self, data: Buffer) -> Any:
        text = str(data, "utf-8")
        try:
            value, end = _decode(text)
        except ValueError:
            return json.loads(text)
        return value if end == len(text) else json.loads(text)


def faster_payloads(cursor: C) -> C:
    """``cursor``, reading ``jsonb`` through ``PayloadLoader`` when its connection reads it with ``json.loads``."""
    default = cursor.adapters.get_loader(_JSONB, pq.Format.TEXT)  # type: ignore[attr-defined]
    if getattr(default, "_loads", None) is json.loads:
        cursor.adapters.register_loader(_JSONB, PayloadLoader)  # type: ignore[attr-defined]
    return cursor
