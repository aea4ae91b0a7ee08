"""Every error sqla-jobs raises, and the two a handler may raise to steer its job.

The tree::

    SqlaJobsError                 root: catch this to catch everything below
    ├── InvalidJob (ValueError)   a Job was built or flushed with a bad field
    ├── ConfigError               bad --url, --app, or option; says what to change
    ├── SchemaError               the job tables are missing or out of date
    ├── ConnectionProblem         the database did not answer (the CLI exits 1)
    ├── NotFound (LookupError)    no job / dead job with that id
    └── JobStateError             the job's state forbids it (cancel a finished job)

    JobSnooze                     raised by a handler: run me again later, no attempt used
    JobCancel                     raised by a handler: stop, do not retry, mark cancelled
    JobParked (BaseException)     raised for you by current_job().sleep / wait_for_event: park the job

Like procrastinate, each class's docstring is its default message, so
``raise SchemaError()`` already says something useful.
"""

from __future__ import annotations

from datetime import datetime


class SqlaJobsError(Exception):
    """An error from sqla-jobs."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class InvalidJob(SqlaJobsError, ValueError):
    """A job has a field that cannot be stored; nothing was written."""


class ConfigError(SqlaJobsError):
    """sqla-jobs was given an option it cannot use."""


class SchemaError(SqlaJobsError):
    """The job tables are missing or out of date: run `sqla-jobs create-tables` or your alembic migrations."""


class ConnectionProblem(SqlaJobsError):
    """The database did not answer."""


class NotFound(SqlaJobsError, LookupError):
    """No job with that id."""


class JobSnooze(Exception):
    """Raise from a handler to run the job again after ``seconds``; the attempt is not counted."""

    def __init__(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("JobSnooze seconds must be >= 0")
        super().__init__(f"snoozed for {seconds:g}s")
        self.seconds = float(seconds)


class JobCancel(Exception):
    """Raise from a handler to stop the job for good: it is marked cancelled, not retried or dead-lettered."""

    def __init__(self, reason: str = "cancelled by handler") -> None:
        super().__init__(reason)
        self.reason = reason


class JobParked(BaseException):
    """Raised by ``current_job().sleep`` / ``sleep_until`` / ``wait_for_event``: this run ends and the job is
    parked until ``until`` (or until event ``key`` is emitted), then runs again from the top, its finished
    steps skipped (sqla_jobs._durable). Not an attempt and not a failure. A ``BaseException``, like
    ``GeneratorExit``, so that ``except Exception`` in a handler lets it through: do not catch it."""

    def __init__(self, name: str, until: datetime, started: datetime, key: str | None = None) -> None:
        super().__init__(f"parked at {name!r} until {until.isoformat()}" + (f" or event {key!r}" if key else ""))
        self.name, self.until, self.started, self.key = name, until, started, key


class JobStateError(SqlaJobsError):
    """The job is not in a state that allows this (e.g. cancelling a finished job)."""
