"""``relayed``: tell an app that some kinds are published by a relay, not run by a worker.

An app with handlers refuses, at flush, a job whose kind has none (a typo must
not reach the table). A relayed kind has no handler of its own, so the app is
told about it: ``relayed`` registers a stand-in whose run fails with a message
that says what went wrong, so a worker that serves the relay's queue by mistake
does not quietly eat the jobs (its failure is retried, and the relay gets
the job on the next attempt).
"""

from __future__ import annotations

from typing import Any

from .._app import JobQueue
from ..errors import ConfigError

__all__ = ["relayed"]


def relayed(app: JobQueue[Any, Any], *kinds: str) -> None:
    """Let ``app`` accept jobs of ``kinds``, which a relay publishes to a broker."""
    if not kinds:
        raise ConfigError("relayed(app, kind, ...) needs at least one kind")
    for kind in kinds:

        def not_here(payload: Any, kind: str = kind) -> None:
            raise RuntimeError(
                f"kind {kind!r} is relayed to a broker by `sqla-jobs relay`, not run by a worker: "
                "serve its queue with a relay only (worker --queue ... without the relay's queue)"
            )

        app.handler(kind)(not_here)
