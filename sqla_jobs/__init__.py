"""sqla-jobs: a background job queue stored in your SQLAlchemy database.

Jobs are rows in your own tables, enqueued in your own transactions and run
by ``sqla-jobs worker``. See README.md and docs/ for the guide.
"""

from ._app import JobEvent, JobQueue
from ._async_admin import AsyncAdmin
from ._backoff import Backoff
from ._batch import Batch, BatchStatus
from ._batch_admin import BatchSummary
from ._context import JobContext, current_job
from ._fair import FairQueue
from ._limits import limits_table
from ._models import MAX_PAYLOAD_BYTES, MAX_PAYLOAD_DEPTH, DeadJobMixin, JobMixin
from ._stats import DeadLetters, QueueLength, QueueStats, RunTime
from ._unique import Enqueued, unique_key
from .drivers.base import MAX_ERROR_LENGTH
from .errors import (
    ConfigError,
    ConnectionProblem,
    InvalidJob,
    JobCancel,
    JobSnooze,
    JobStateError,
    NotFound,
    SchemaError,
    SqlaJobsError,
)
from .worker.async_worker import AsyncWorker
from .worker.worker import Worker

__version__ = "0.1.0"

__all__ = [
    "MAX_ERROR_LENGTH",
    "MAX_PAYLOAD_BYTES",
    "MAX_PAYLOAD_DEPTH",
    "AsyncAdmin",
    "AsyncWorker",
    "Backoff",
    "Batch",
    "BatchStatus",
    "BatchSummary",
    "ConfigError",
    "ConnectionProblem",
    "DeadJobMixin",
    "DeadLetters",
    "Enqueued",
    "FairQueue",
    "InvalidJob",
    "JobCancel",
    "JobContext",
    "JobEvent",
    "JobMixin",
    "JobQueue",
    "JobSnooze",
    "JobStateError",
    "NotFound",
    "QueueLength",
    "QueueStats",
    "RunTime",
    "SchemaError",
    "SqlaJobsError",
    "Worker",
    "current_job",
    "limits_table",
    "unique_key",
]
