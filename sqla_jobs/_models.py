"""The job tables, as mixins for your own declarative models.

Add two classes to your application's metadata (``Base``: your ``DeclarativeBase``)::

    class Job(JobMixin, Base):
        __tablename__ = "jobs"

    class DeadJob(DeadJobMixin, Base):
        __tablename__ = "dead_jobs"

``Base.metadata.create_all(engine)`` (or your alembic migrations) creates them.
Enqueue a job by adding a row in the same transaction as your business rows
(``session.add(Job(kind="send_email", payload={...}))``): committed means it
will run; rolled back means it never existed.

A job moves through explicit states (the ``state`` column):

``blocked``   waiting for the jobs it ``depends_on`` (``waiting_for`` of them) to end (``sqla_jobs._graph``),
              or for its turn in its sequence (``sqla_jobs._sequence``)
``pending``   waiting for ``run_at``; ``attempts`` says how many runs it has had
``running``   claimed by a worker, whose lease ends at ``lease_expires_at``
``finished``  done; ``finished_at - locked_at`` is how long the last run took
``cancelled`` stopped by ``JobCancel`` or ``sqla-jobs jobs cancel``; never runs again

A job that fails ``max_attempts`` times leaves this table for the dead-letter
table (``DeadJobMixin``), from which a person can requeue it.

Fields are checked when set and again at flush, so a bad job fails before your
business transaction commits (``payload``: see ``sqla_jobs._payload`` and docs/howto/enqueue.md).

If you need ``__table_args__`` of your own (a schema, extra indexes), build
them with ``JobMixin.table_args(...)`` so sqla-jobs' own indexes stay::

    class Job(JobMixin, Base):
        __tablename__ = "jobs"
        __table_args__ = JobMixin.table_args(Index("ix_jobs_kind", "kind"), schema="work")
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Index, Integer, String, Text, event, text
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.orm import Mapped, Mapper, declared_attr, mapped_column, validates
from sqlalchemy.orm.attributes import instance_dict

from . import _payload
from ._batch import BatchOf
from ._fair import FairKeyed, fair_indexes
from ._fields import MAX_KIND_LENGTH, MAX_QUEUE_LENGTH, enqueue_checks, int_field, text_field, unique_fields, utc
from ._graph import DependsOn, check_policy
from ._payload import MAX_PAYLOAD_BYTES, MAX_PAYLOAD_DEPTH, MAX_PROGRESS_BYTES, MAX_RESULT_BYTES, PayloadType
from ._sequence import enlist
from ._typed import as_payload
from ._unique import HELD_KEY_SQL, MAX_UNIQUE_KEY_LENGTH, StateSet, check_key, check_states
from .drivers import (
    MAX_SEQUENCE_KEY_LENGTH,
    DatabaseNow,
    GeneratedColumn,
    attach_table_events,
    column_type,
    index_dialects_for,
    partial_where,
    side_tables,
    table_options,
)
from .drivers._dashboard import list_indexes
from .errors import InvalidJob

__all__ = ["MAX_PAYLOAD_BYTES", "MAX_PAYLOAD_DEPTH", "STATES", "DeadJobMixin", "JobMixin"]

STATES = ("blocked", "pending", "running", "finished", "cancelled")

# The portable column types, with each backend's own as its variant where the portable one will not do
# (Driver.column_type: an INTEGER id on SQLite, jsonb on PostgreSQL, JSON as LONGTEXT and DATETIME(6) on
# MariaDB/MySQL; see sqla_jobs/drivers). The payload's type sends the text encoded at flush (see _payload).
_ID = column_type("id", BigInteger())
_JSON = column_type("json", JSON())
_PAYLOAD = column_type("json", JSON(), wrap=PayloadType)
_JSON_OR_NULL = column_type("json", JSON(), none_as_null=True)  # None stays SQL NULL (to the dead letters and back)
# The database clock, on every backend: CURRENT_TIMESTAMP, or UTC with microseconds where
# the column has no time zone (MariaDB/MySQL: see DatabaseNow in sqla_jobs/drivers).
_NOW = DatabaseNow()
# Index rules: a backend with partial indexes leaves out of an index the rows it never looks for; one
# without (MariaDB/MySQL) gets the same index led by `state` (Driver.partial_indexes).
_PARTIAL = index_dialects_for(partial=True)
_NO_PARTIAL = index_dialects_for(partial=False)
#: Table options, every backend's (Driver.table_options: SQLite's AUTOINCREMENT, MariaDB/MySQL's collation).
_JOB_OPTIONS = table_options("jobs")
_DEAD_OPTIONS = table_options("dead")
# Defaults live in the database only. A column with no default at all would be sent as an explicit NULL in
# every ORM INSERT (SQLAlchemy keeps batches uniform that way): 14 parameters a row, not 2: `add_all` 2.5x slower.
_NULL = text("NULL")


def _tz() -> Any:
    # Time zone aware; where a backend's type has none (MariaDB/MySQL), it holds UTC with microseconds.
    return column_type("timestamp", DateTime(timezone=True))


def timestamp_type() -> Any:
    """The column type of every sqla-jobs timestamp (time zone aware; microseconds on MariaDB/MySQL)."""
    return _tz()


class _Common(FairKeyed):
    """Columns both tables share, so a dead job carries everything needed to requeue it."""

    max_payload_bytes: ClassVar[int] = MAX_PAYLOAD_BYTES

    kind: Mapped[str] = mapped_column(String(MAX_KIND_LENGTH))
    queue: Mapped[str] = mapped_column(String(MAX_QUEUE_LENGTH), server_default="default")
    payload: Mapped[dict[str, Any]] = mapped_column(_PAYLOAD)
    priority: Mapped[int] = mapped_column(Integer, server_default="0")
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    max_attempts: Mapped[int] = mapped_column(Integer, server_default="5")
    created_at: Mapped[datetime] = mapped_column(_tz(), server_default=_NOW)
    last_error: Mapped[str | None] = mapped_column(Text, server_default=_NULL)
    #: Every failure so far: a list of {"attempt", "at", "error"} objects.
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(_JSON, server_default=_NULL)
    #: At most one job holds a key at a time, while in its ``unique_states`` (see sqla_jobs._unique).
    #: A dead job keeps it for the record only: it holds nothing, and a requeue leaves it behind.
    unique_key: Mapped[str | None] = mapped_column(String(MAX_UNIQUE_KEY_LENGTH), server_default=_NULL)
    #: The W3C trace context of the span current at enqueue, with tracing on (``sqla_jobs.otel``).
    trace_context: Mapped[dict[str, str] | None] = mapped_column(_JSON_OR_NULL, server_default=_NULL)
    #: Jobs with the same key run one at a time, in enqueue order (``sqla_jobs._sequence``).
    sequence_key: Mapped[str | None] = mapped_column(String(MAX_SEQUENCE_KEY_LENGTH), server_default=_NULL)

    def __init__(self, **fields: Any) -> None:
        """``Job(kind=..., payload=...)``: what SQLAlchemy's declarative constructor does, for less.

        A field that has one of sqla-jobs' validators (and no other listener) is
        checked by that validator and stored directly: the attribute event that
        would run the same validator costs more than the check itself, and a new
        object has no history to keep (its INSERT reads the stored values). Any
        other field, and every later assignment, goes through SQLAlchemy as usual.
        """
        cls = type(self)
        direct = _DIRECT_FIELDS.get(cls)
        if direct is None:
            direct = _direct_fields(cls)
        values = instance_dict(self)
        for key, value in fields.items():
            field = direct.get(key)
            # Its set listeners are counted each time: one added since (by the app) must run.
            if field is not None and len(field[1]) == 1:
                values[key] = field[0](self, key, value)
            elif hasattr(cls, key):
                setattr(self, key, value)
            else:
                raise TypeError(f"{key!r} is an invalid keyword argument for {cls.__name__}")

    @validates("kind")
    def _check_kind(self, key: str, value: Any) -> str:
        return text_field(key, value, MAX_KIND_LENGTH)

    @validates("queue")
    def _check_queue(self, key: str, value: Any) -> str:
        return text_field(key, value, MAX_QUEUE_LENGTH)

    @validates("payload")
    def _check_payload(self, key: str, value: Any) -> dict[str, Any]:
        if type(value) is not dict:
            value = as_payload(value)  # a typed payload's instance (sqla_jobs._typed) is stored as its dict
        _payload.check(value, self.max_payload_bytes)
        return value  # type: ignore[no-any-return]

    @validates("unique_key")
    def _check_unique_key(self, key: str, value: Any) -> str | None:
        return None if value is None else check_key(value)

    @validates("max_attempts")
    def _check_max_attempts(self, key: str, value: Any) -> int:
        return int_field(key, value, 1)

    @validates("priority", "attempts")
    def _check_int(self, key: str, value: Any) -> int:
        return int_field(key, value, 0 if key == "attempts" else None)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} id={self.id!r} kind={self.kind!r}>"  # type: ignore[attr-defined]


#: Per model: the fields ``__init__`` may check and store without an attribute event:
#: their validator, and their set listeners (the validator's alone, while nobody adds one).
_DIRECT_FIELDS: dict[type[Any], dict[str, tuple[Callable[[Any, str, Any], Any], Sized]]] = {}


def _direct_fields(model: type[Any]) -> dict[str, tuple[Callable[[Any, str, Any], Any], Sized]]:
    """The fields validated by one of sqla-jobs' validators (not a subclass's), with their set listeners."""
    own = {method for cls in (_Common, JobMixin) for method in vars(cls).values()
           if hasattr(method, "__sa_validators__")}
    direct = {}
    for key, (validator, _options) in sa_inspect(model).validators.items():
        if validator in own:
            direct[key] = (validator, getattr(model, key).impl.dispatch.set)
    _DIRECT_FIELDS[model] = direct
    return direct


class JobMixin(_Common):
    """Columns and indexes of the jobs table. The seed's nine columns keep their meaning."""

    #: Limits on a handler's return value and progress value, in bytes of JSON; override per model.
    max_result_bytes: ClassVar[int] = MAX_RESULT_BYTES
    max_progress_bytes: ClassVar[int] = MAX_PROGRESS_BYTES

    id: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=True)
    state: Mapped[str] = mapped_column(String(16), server_default="pending")
    run_at: Mapped[datetime] = mapped_column(_tz(), server_default=_NOW)
    #: When the current (or last) run was claimed.
    locked_at: Mapped[datetime | None] = mapped_column(_tz(), server_default=_NULL)
    #: Which worker holds the claim, as host:pid:name, for people reading the table.
    locked_by: Mapped[str | None] = mapped_column(String(255), server_default=_NULL)
    #: Changes on every claim; every write a worker makes is fenced by it.
    claim_token: Mapped[str | None] = mapped_column(String(64), server_default=_NULL)
    #: The claim is void after this moment (database clock) unless heartbeats extend it.
    lease_expires_at: Mapped[datetime | None] = mapped_column(_tz(), server_default=_NULL)
    finished_at: Mapped[datetime | None] = mapped_column(_tz(), server_default=_NULL)
    #: Set by a cancel request; a running job sees it when it ends.
    cancelled_at: Mapped[datetime | None] = mapped_column(_tz(), server_default=_NULL)
    #: Its worker process was lost while it ran: its next run is alone in a worker process
    #: (see docs/guarantees.md, "Poison jobs"). Cleared when that run ends, whatever the outcome.
    isolate: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    #: The states in which the job holds its ``unique_key`` (default pending and running), as a bitmask.
    unique_states: Mapped[tuple[str, ...] | None] = mapped_column(StateSet(), server_default=_NULL)
    #: Generated by the database: ``unique_key`` while the state is one of ``unique_states``, else NULL.
    #: Its unique index is what makes a key unique (a generated column, because MariaDB/MySQL have no
    #: partial indexes; virtual on SQLite and MariaDB, stored on PostgreSQL).
    unique_held: Mapped[str | None] = mapped_column(String(MAX_UNIQUE_KEY_LENGTH),
                                                          GeneratedColumn(HELD_KEY_SQL))
    #: What the handler returned (JSON), stored with the finished job; NULL when it returned None.
    result: Mapped[Any] = mapped_column(_JSON, nullable=True, server_default=_NULL)
    #: The last value the handler gave ``current_job().set_progress(...)``, written about once a second.
    progress: Mapped[Any] = mapped_column(_JSON, nullable=True, server_default=_NULL)
    #: How many of the jobs it depends on have not ended yet; it is ``blocked`` until none (``sqla_jobs._graph``).
    waiting_for: Mapped[int] = mapped_column(Integer, server_default="0")
    #: Some job depends on this one: its end is passed on to them in the transaction that records it.
    has_dependents: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    #: When an upstream is dead-lettered or cancelled: ``cancel`` (None: the default), ``run`` or ``wait``.
    on_upstream_failure: Mapped[str | None] = mapped_column(String(8), server_default=_NULL)

    #: The jobs this one waits for (objects or ids), set before its first flush (``sqla_jobs._graph``).
    depends_on: ClassVar[DependsOn] = DependsOn()
    #: The ``Batch`` (or a batch's id) this job is a member of, set before its first flush (``sqla_jobs._batch``).
    batch: ClassVar[BatchOf] = BatchOf()

    @validates("run_at")
    def _check_run_at(self, key: str, value: Any) -> datetime | None:
        return utc(key, value)

    @validates("on_upstream_failure")
    def _check_on_upstream_failure(self, key: str, value: Any) -> str | None:
        return check_policy(value)

    @validates("sequence_key")
    def _check_sequence_key(self, key: str, value: Any) -> str | None:
        return enlist(self, value)

    @validates("unique_states")
    def _check_unique_states(self, key: str, value: Any) -> tuple[str, ...] | None:
        return None if value is None else check_states(value)

    @declared_attr.directive
    def __table_args__(self) -> Any:
        return (*self.job_indexes(), dict(_JOB_OPTIONS))

    @declared_attr.directive
    def __mapper_args__(self) -> Any:
        # Don't read the 14 server-defaulted columns back with every INSERT: an
        # enqueuing request rarely looks at them, and they load on first access.
        return {"eager_defaults": False}

    @classmethod
    def job_indexes(cls) -> list[Index]:
        """The indexes the queue needs, named after this class's table."""
        name = cls.__tablename__  # type: ignore[attr-defined]
        return [
            # The claim: due jobs, most urgent and oldest first, in index order
            # (no sort). A queue filter is applied while scanning; see docs on
            # adding (queue, priority DESC, run_at, id) when workers are split by queue.
            Index(
                f"ix_{name}_pending",
                text("priority DESC"),
                "run_at",
                "id",
                **partial_where("state = 'pending'"),
            ).ddl_if(dialect=_PARTIAL),
            # The same without a WHERE (MariaDB/MySQL): `state` leads, so the claim reads the
            # pending range in claim order and never the finished rows (docs/howto/backends.md).
            Index(f"ix_{name}_pending", "state", text("priority DESC"), "run_at", "id").ddl_if(dialect=_NO_PARTIAL),
            # The lease reaper: running jobs whose lease ran out.
            Index(
                f"ix_{name}_running",
                "lease_expires_at",
                **partial_where("state = 'running'"),
            ).ddl_if(dialect=_PARTIAL),
            Index(f"ix_{name}_running", "state", "lease_expires_at").ddl_if(dialect=_NO_PARTIAL),
            # Unique jobs: one holder per key (sqla_jobs._unique). NULL for every job without a key or
            # out of its unique states: left out of the index where it can be partial.
            Index(f"ux_{name}_unique", "unique_held", unique=True,
                  **partial_where("unique_held IS NOT NULL")).ddl_if(dialect=_PARTIAL),
            Index(f"ux_{name}_unique", "unique_held", unique=True).ddl_if(dialect=_NO_PARTIAL),
            # `jobs list --unique-key`, finished jobs included.
            Index(f"ix_{name}_unique_key", "unique_key",
                  **partial_where("unique_key IS NOT NULL")).ddl_if(dialect=_PARTIAL),
            Index(f"ix_{name}_unique_key", "unique_key").ddl_if(dialect=_NO_PARTIAL),
            # The dashboard's lists by the page: `state=cancelled` (rare rows: the primary key walked every finished
            # one; MariaDB's `state`-led indexes find them), and a queue's or a kind's jobs (list_indexes).
            Index(f"ix_{name}_cancelled", "id", **partial_where("state = 'cancelled'")).ddl_if(dialect=_PARTIAL),
            *list_indexes(name),
            # Jobs waiting for their upstreams (sqla_jobs._graph): counted by `stats`, listed by `state=blocked`.
            Index(f"ix_{name}_blocked", "id", **partial_where("state = 'blocked'")).ddl_if(dialect=_PARTIAL),
            # A sequence's jobs in order (`jobs list --sequence-key`); only the rows that have a key.
            Index(f"ix_{name}_sequence", "sequence_key", "id",
                  **partial_where("sequence_key IS NOT NULL")).ddl_if(dialect=_PARTIAL),
            Index(f"ix_{name}_sequence", "sequence_key", "id").ddl_if(dialect=_NO_PARTIAL),
            # Run-time figures and pruning of old finished jobs (NULLs are few and cheap without a WHERE).
            Index(f"ix_{name}_finished", "finished_at", **partial_where("finished_at IS NOT NULL")),
            *fair_indexes(name),  # fair queues' claim (sqla_jobs._fair)
        ]

    @classmethod
    def table_args(cls, *extra: Any, **options: Any) -> Any:
        """``__table_args__`` with the queue's indexes plus your own items and options."""

        def build(target: type[JobMixin]) -> Any:
            return (*target.job_indexes(), *extra, {**_JOB_OPTIONS, **options})

        return declared_attr.directive(build)


class DeadJobMixin(_Common):
    """Columns of the dead-letter table: jobs that used up their attempts.

    ``id`` is the id the job had in the jobs table, so a requeued job keeps it.
    There is deliberately no foreign key between the two tables.
    """

    id: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=False)
    run_at: Mapped[datetime | None] = mapped_column(_tz(), server_default=_NULL)
    failed_at: Mapped[datetime] = mapped_column(_tz(), server_default=_NOW)

    @declared_attr.directive
    def __table_args__(self) -> Any:
        return (*self.dead_indexes(), dict(_DEAD_OPTIONS))

    @classmethod
    def dead_indexes(cls) -> list[Index]:
        name = cls.__tablename__  # type: ignore[attr-defined]
        return [Index(f"ix_{name}_kind", "kind", "failed_at")]

    @classmethod
    def table_args(cls, *extra: Any, **options: Any) -> Any:
        """``__table_args__`` with the dead-letter indexes plus your own items and options."""

        def build(target: type[DeadJobMixin]) -> Any:
            return (*target.dead_indexes(), *extra, {**_DEAD_OPTIONS, **options})

        return declared_attr.directive(build)


@event.listens_for(JobMixin, "before_insert", propagate=True)
@event.listens_for(DeadJobMixin, "before_insert", propagate=True)
def _check_before_insert(mapper: Mapper[Any], connection: Any, target: Any) -> None:
    """Fields never set (so never validated) are checked here, before the INSERT."""
    # Read from the instance's dict: a field never set is simply absent, where the
    # attribute would go through SQLAlchemy's loader machinery (microseconds per row).
    fields = instance_dict(target)
    if fields.get("kind") is None:
        raise InvalidJob("Job.kind is required: the name of the handler that runs the job")
    payload = fields.get("payload")
    if payload is None:
        target.payload = payload = {}
    if isinstance(target, JobMixin):
        key, states = fields.get("unique_key"), fields.get("unique_states")
        if key is not None or states is not None:
            checked = unique_fields(key, states)
            if states is None and checked["unique_states"] is not None:
                target.unique_states = checked["unique_states"]
    # Checked again, as the dict may have been changed in place since it was set;
    # the text is kept for the INSERT, so this is the job's only encoding.
    _payload.remember(target, payload, _payload.encode(payload, type(target).max_payload_bytes))
    for check in enqueue_checks(type(target)):
        check(target)


@event.listens_for(JobMixin, "instrument_class", propagate=True)
def _add_notify_trigger(mapper: Mapper[Any], cls: type[JobMixin]) -> None:
    """Create the wake-up trigger with the table, on PostgreSQL (see ``drivers.pg_notify.notify_trigger_ddl``).

    ``create_all`` and ``sqla-jobs create-tables`` create it; the rendered
    alembic revision creates it too. Without it workers still find new jobs
    by polling, only later.
    """
    attach_table_events(cls.__table__)  # type: ignore[attr-defined]
    side_tables(cls.__table__)  # type: ignore[attr-defined]  # <jobs>_deps, _batches, ...: same metadata
