"""The values a driver hands the worker: a claimed job and its fence, and what a wake-up listener is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["DEAD_COLUMNS", "AsyncListener", "Claimed", "Fence", "Listener"]

Fence = tuple[int, str]  # (job id, claim token)
#: What a dead-lettered job carries over from its row (its unique key for the record only: it holds nothing there).
DEAD_COLUMNS = ("id", "kind", "queue", "payload", "priority", "attempts", "max_attempts", "created_at", "run_at",
                "unique_key", "trace_context", "sequence_key", "fair_key")


@dataclass(slots=True)  # not frozen: frozen dataclasses are several times slower to build
class Claimed:
    """What a worker needs from a freshly claimed row."""

    id: int
    kind: str
    queue: str
    payload: dict[str, Any]
    attempt: int
    max_attempts: int
    priority: int
    token: str
    #: Its last worker was lost while it ran: the worker runs it alone (see docs/guarantees.md).
    isolated: bool = False
    #: Other jobs depend on it (job graphs): its finish counts them down (drivers/postgresql/handoff.py).
    has_dependents: bool = False

    @property
    def fence(self) -> Fence:
        return (self.id, self.token)


class Listener(Protocol):
    """What ``Driver.listener`` returns: wakes a worker when a job is enqueued (PostgreSQL: ``pg_listen``)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


class AsyncListener(Protocol):
    """What ``Driver.async_listener`` returns: the same, as a task on the async worker's event loop."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...
