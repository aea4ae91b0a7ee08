"""``relayed``: tell an app that some kinds are published by a relay, not run by a worker.

An app with handlers refuses, at flush, a job whose kind has none (a typo must
not reach the table). A relayed kind has no handler of its own, so the app is
told about it: ``relayed`` registers a stand-in. A worker that serves the
relay's queue by mistake (one started without ``--queues`` serves every queue)
runs the stand-in, which logs a warning naming the mistake and snoozes the job
(``JobSnooze``: no attempt counted, no error), so the job waits for the relay
instead of being failed into the dead letters.
"""

from __future__ import annotations

import logging
from typing import Any

from .._app import JobQueue
from ..errors import ConfigError, JobSnooze

__all__ = ["SNOOZE_SECONDS", "relayed"]

log = logging.getLogger("sqla_jobs.relay")

#: How long a relayed job a worker took by mistake waits before it is due again (for the relay, or that worker).
SNOOZE_SECONDS = 10.0


def relayed(app: JobQueue[Any, Any], *kinds: str) -> None:
    """Let ``app`` accept jobs of ``kinds``, which a relay publishes to a broker."""
    if not kinds:
        raise ConfigError("relayed(app, kind, ...) needs at least one kind")
    for kind in kinds:

        def not_here(payload: Any, kind: str = kind) -> None:
            log.warning("a worker took a job of kind %r, which `sqla-jobs relay` publishes; it is put back "
                        "for %gs. Start workers with --queues that leave out the relay's queue", kind,
                        SNOOZE_SECONDS)
            raise JobSnooze(SNOOZE_SECONDS)

        app.handler(kind)(not_here)
