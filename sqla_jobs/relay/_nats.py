"""``NatsTarget``: publish to NATS JetStream through nats-py, ``Nats-Msg-Id`` = the job id.

JetStream acknowledges each publish once the stream stored it (``PubAck``);
the relay finishes a job only then. A batch goes out through nats-py's
``publish_async``: every message is written at once with a reply subject of
one shared subscription, and the acks are awaited together (``js.publish``
made a request per message, each with its own reply inbox, future and timer,
and the client's work per message was most of the relay's time). A connection
that drops fails the batch at once instead of after ``confirm_timeout``. The stream drops a second message with the
same ``Nats-Msg-Id`` within its duplicate window (2 minutes by default), so a
job published again after a relay crash is stored once if it comes back
within the window; after it, consumers see the id twice and deduplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ConfigError
from ._message import BrokerUnavailable, Outgoing, route_for
from ._rabbitmq import without_password

__all__ = ["NatsTarget"]

#: Most messages awaiting their PubAck at once, for nats-py's own bound: what a relay holds in flight at
#: its largest batch (2 batches of 10,000, sqla_jobs.relay._loop.in_flight), so it never waits on it.
MAX_PENDING_ACKS = 20_000
#: More than the relay's header block can take (``_wire_size``: the fixed names and lines, a job id, the
#: kind and queue at their longest, 4 bytes a character): a body this far under max_payload needs no count.
_HEADER_ROOM = 4096


def _client() -> Any:
    try:
        import nats
    except ImportError:
        raise ConfigError("NatsTarget needs nats-py: pip install 'sqla-jobs[nats]'") from None
    return nats


class NatsTarget:
    """Publish jobs to NATS JetStream subjects.

    ``routes`` maps a job kind to its subject; a ``"*"`` entry is the subject of
    every other kind, with ``{kind}`` replaced by the kind. ``stream`` and
    ``subjects``: a stream to create if it does not exist (file storage, the
    given duplicate window), so the subjects are stored before any consumer
    starts; an existing stream is left as it is.
    """

    def __init__(
        self,
        url: str,
        *,
        routes: Mapping[str, str],
        stream: str | None = None,
        subjects: Sequence[str] = (),
        duplicate_window: float = 120.0,
    ) -> None:
        if not url.startswith(("nats://", "tls://", "ws://", "wss://")):
            raise ConfigError(f"NATS URL must start with nats:// (or tls://), got {without_password(url)!r}")
        if not routes:
            raise ConfigError("NatsTarget needs at least one route: routes={'order.created': 'orders.created'}")
        if subjects and not stream:
            raise ConfigError("NatsTarget: subjects= are the subjects of a stream; name it with stream=")
        if duplicate_window <= 0:
            raise ConfigError("NatsTarget: duplicate_window must be > 0 seconds")
        self.url = url
        self.routes = dict(routes)
        self.stream = stream
        self.subjects = list(subjects) or sorted({s for s in self.routes.values() if "{kind}" not in s})
        self.duplicate_window = duplicate_window
        self._nc: Any = None
        self._js: Any = None
        self._lost: asyncio.Event | None = None  # set when the connection closes: pending acks will never come

    def route(self, kind: str) -> str | None:
        return route_for(self.routes, kind)

    def describe(self) -> str:
        routes = ", ".join(f"{k} -> {v}" for k, v in self.routes.items())
        stream = f" stream {self.stream!r}" if self.stream else ""
        return f"NATS JetStream {without_password(self.url)}{stream} ({routes})"

    async def connect(self) -> None:
        nats = _client()
        await self.close()
        try:
            # The relay reconnects itself (and releases the batch in flight), so nats-py must not
            # buffer publishes across a reconnect of its own.
            lost = self._lost = asyncio.Event()

            async def closed() -> None:
                lost.set()

            self._nc = await nats.connect(self.url, allow_reconnect=False, connect_timeout=5, max_reconnect_attempts=0,
                                          disconnected_cb=closed, closed_cb=closed)
            self._js = self._nc.jetstream(publish_async_max_pending=MAX_PENDING_ACKS)
            if self.stream:
                await self._ensure_stream(nats)
        except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
            await self.close()
            raise BrokerUnavailable(f"NATS at {without_password(self.url)}: {exc!r}") from exc

    async def _ensure_stream(self, nats: Any) -> None:
        try:
            await self._js.stream_info(self.stream)
        except nats.js.errors.NotFoundError:
            await self._js.add_stream(
                name=self.stream, subjects=self.subjects, duplicate_window=self.duplicate_window,
                storage=nats.js.api.StorageType.FILE,
            )

    async def publish(self, messages: list[Outgoing], timeout: float) -> dict[int, str | None]:
        nats = _client()
        if self._js is None or self._nc is None or not self._nc.is_connected:
            raise BrokerUnavailable("not connected to NATS")
        outcome: dict[int, str | None] = {}
        limit = self._nc.max_payload
        sendable = []
        for m in messages:
            headers = {"Nats-Msg-Id": m.message_id, **m.headers}
            if len(m.body) + _HEADER_ROOM > limit and _wire_size(m.body, headers) > limit:
                # nats-py checks the body only; the server closes the whole connection for a message
                # whose body and headers exceed max_payload, which would cost the batch a reconnect.
                outcome[m.job.id] = (f"the message ({len(m.body)} bytes of payload plus headers) is larger than "
                                     f"the NATS server's max_payload ({limit} bytes)")
            else:
                sendable.append((m, headers))
        messages = []
        acks = []
        js, lost = self._js, self._lost
        try:
            for m, headers in sendable:
                try:
                    acks.append(await js.publish_async(self.route(m.job.kind) or "", m.body, headers=headers))
                except nats.errors.MaxPayloadError:
                    outcome[m.job.id] = "the message is larger than the NATS server's max_payload"
                    continue
                messages.append(m)
        except nats.errors.Error as exc:  # closed, or cut while writing: nothing of the batch counts
            _forget(acks)
            raise BrokerUnavailable(f"NATS publish failed: {exc!r}") from exc
        results = await _answers(acks, lost, timeout)
        for message, result in zip(messages, results, strict=True):
            if not isinstance(result, BaseException):
                outcome[message.job.id] = None
            elif isinstance(result, nats.errors.MaxPayloadError):
                outcome[message.job.id] = "the message is larger than the NATS server's max_payload"
            elif isinstance(result, (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError)):
                outcome[message.job.id] = (f"no JetStream stream stores subject {self.route(message.job.kind)!r}: "
                                           "add it to a stream's subjects")
            elif isinstance(result, nats.js.errors.APIError) and not isinstance(
                result, (nats.js.errors.ServiceUnavailableError, nats.js.errors.ServerError)
            ):
                outcome[message.job.id] = f"JetStream refused the message: {result!r}"
            else:
                raise BrokerUnavailable(f"NATS publish failed: {result!r}") from result
        return outcome

    async def close(self) -> None:
        nc, self._nc, self._js, self._lost = self._nc, None, None, None
        if nc is not None:
            with contextlib.suppress(Exception):  # already cut: nothing left to close
                await asyncio.wait_for(nc.close(), 5)


async def _answers(acks: list[asyncio.Future[Any]], lost: asyncio.Event | None, timeout: float) -> list[Any]:
    """Each ack's PubAck or error, once all came; ``BrokerUnavailable`` if the connection closed first or
    they did not all come within ``timeout`` (then none of the batch counts as delivered)."""
    if not acks:
        return []
    together = asyncio.gather(*acks, return_exceptions=True)
    closed = asyncio.ensure_future(lost.wait()) if lost is not None else None
    try:
        await asyncio.wait([together] if closed is None else [together, closed], timeout=timeout,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        if closed is not None:
            closed.cancel()
    if together.done():
        return together.result()
    together.cancel()
    if lost is not None and lost.is_set():
        raise BrokerUnavailable(f"the NATS connection closed with {len(acks)} message(s) awaiting JetStream's ack")
    raise BrokerUnavailable(f"JetStream did not acknowledge {len(acks)} message(s) within {timeout:g}s")


def _forget(acks: list[asyncio.Future[Any]]) -> None:
    """Give up the acks of a batch that failed while being written (their futures never resolve)."""
    for ack in acks:
        ack.cancel()


def _wire_size(body: bytes, headers: dict[str, str]) -> int:
    """What the server counts against max_payload: the header block (``NATS/1.0``, one line per
    header, a blank line) plus the body."""
    block = len("NATS/1.0\r\n") + sum(len(k.encode()) + 2 + len(v.encode()) + 2 for k, v in headers.items()) + 2
    return block + len(body)
