"""Limits across all workers: how many jobs of a kind run at once, and how fast they start.

Declared where a kind is registered::

    @queue.handler("sync_account", limit=3)                        # at most 3 running, cluster-wide
    @queue.handler("sync_customer", limit=1, limit_key="customer")  # at most 1 per payload["customer"]
    @queue.handler("send_sms", rate=(14, 1.0))                      # at most 14 starts a second

The claim enforces them (``sqla_jobs.drivers._limits``): a job over its
limit stays ``pending``, its attempts untouched, until a slot or a token is
free. The claim of a limited kind takes a row lock on that kind's row in
``<jobs table>_limits`` (``limits_table``), which also keeps the rate's token
bucket; kinds without limits never touch it.

Every worker of a table must run an app that declares the same limits: a
worker whose app does not know a limit claims that kind freely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, Double, MetaData, String, Table, inspect
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from ._companion import HasJobModel, companion_table
from ._models import MAX_KIND_LENGTH, timestamp_type
from .errors import ConfigError

__all__ = ["KindLimit", "ensure_limits_table", "limits_table", "make_limit"]

#: The longest payload field name a per-key limit reads.
MAX_KEY_FIELD_LENGTH = 64


@dataclass(frozen=True)
class KindLimit:
    """The limits of one kind, as the claim applies them."""

    kind: str
    #: At most this many jobs of the kind running at once (None: no limit), across all workers.
    running: int | None = None
    #: With ``running``: the limit holds per value of this top-level payload field instead of per kind.
    key: str | None = None
    #: At most ``rate_count`` starts per ``rate_period`` seconds (a token bucket holding ``rate_count``).
    rate_count: int | None = None
    rate_period: float | None = None

    @property
    def row(self) -> str:
        """This kind's row in the limits table (its lock, and the rate's bucket)."""
        return f"kind:{self.kind}"

    @property
    def refill(self) -> float:
        """Tokens a second (0 without a rate)."""
        return self.rate_count / self.rate_period if self.rate_count and self.rate_period else 0.0


def make_limit(kind: str, limit: int | None, limit_key: str | None, rate: Any) -> KindLimit | None:
    """Check a handler's ``limit`` / ``limit_key`` / ``rate`` options; None when it has none."""
    if limit is None and limit_key is None and rate is None:
        return None
    where = f"handler {kind!r}"
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"{where}: limit must be a whole number of running jobs >= 1, got {limit!r}")
    if limit_key is not None:
        if limit is None:
            raise ConfigError(f"{where}: limit_key={limit_key!r} needs limit= (how many may run per key)")
        if not isinstance(limit_key, str) or not limit_key or len(limit_key) > MAX_KEY_FIELD_LENGTH \
                or not limit_key.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"{where}: limit_key must name a top-level payload field (letters, digits, _ and -, "
                              f"at most {MAX_KEY_FIELD_LENGTH}), got {limit_key!r}")
    count = period = None
    if rate is not None:
        try:
            count, period = rate
            count, period = int(count), float(period)
            valid = count >= 1 and period > 0 and count == rate[0]
        except (TypeError, ValueError):
            valid = False
        if not valid:
            raise ConfigError(f"{where}: rate must be (starts, seconds), e.g. rate=(14, 1.0) for 14 a second, "
                              f"got {rate!r}")
    return KindLimit(kind, limit, limit_key, count, period)


def limits_table(queue: HasJobModel, metadata: MetaData | None = None) -> Table:
    """``<jobs table>_limits`` of ``queue``: one row per limited kind (declared in ``metadata`` if given).

    ``name`` is the kind's row (``kind:<kind>``); ``tokens`` and ``updated_at``
    are its rate's bucket (NULL without a rate). Declare it in your metadata
    to have alembic autogenerate create it; otherwise a worker whose app has
    limits creates it when it starts.
    """
    return companion_table(queue, "limits", metadata, lambda name: [
        Column("name", String(MAX_KIND_LENGTH + 8), primary_key=True),
        Column("tokens", Double, nullable=True),
        Column("updated_at", timestamp_type(), nullable=True),
    ])


def ensure_limits_table(engine: Engine, table: Table) -> None:
    """Create the limits table if it is missing (a worker with limits, at start).

    Workers starting together may all find it missing; PostgreSQL then refuses all but one ``CREATE TABLE``
    (a duplicate type name, even with ``IF NOT EXISTS``). The table being there afterwards is what counts.
    """
    with engine.connect() as conn:
        if inspect(conn).has_table(table.name, schema=table.schema):
            return
        try:
            table.create(conn, checkfirst=True)
            conn.commit()
        except SQLAlchemyError:
            conn.rollback()
            if not inspect(conn).has_table(table.name, schema=table.schema):
                raise
