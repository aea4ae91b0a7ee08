"""``NatsTarget``: publish to NATS JetStream through nats-py, ``Nats-Msg-Id`` = the job id.

JetStream acknowledges each publish once the stream stored it (``PubAck``);
the relay finishes a job only then. A batch is written at once, each message
with a reply subject of its own under one subscription of the connection
(``_Replies``), and the batch waits until every message has its answer. nats-py's
``js.publish`` made a request per message, and its ``publish_async`` still
costs a future, a semaphore wait, a random token and a parsed ``PubAck`` per
message: the client's work was most of the relay's time. A connection
that drops fails the batch at once instead of after ``confirm_timeout``. The stream drops a second message with the
same ``Nats-Msg-Id`` within its duplicate window (2 minutes by default), so a
job published again after a relay crash is stored once if it comes back
within the window; after it, consumers see the id twice and deduplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ConfigError
from ._message import HEADER_ID, BrokerUnavailable, Outgoing, route_for
from ._rabbitmq import without_password

__all__ = ["NatsTarget"]

#: JetStream's error codes that say the server cannot store now (not that it refuses this message).
_UNAVAILABLE = (500, 503)
#: An answer that says no stream stores the subject (a "503" status with no body: no responders).
_NO_STREAM = "no stream"
#: More than the relay's header block can take (``_wire_size``: the fixed names and lines, a job id, the
#: kind and queue at their longest, 4 bytes a character): a body this far under max_payload needs no count.
_HEADER_ROOM = 4096
#: Seconds a batch may take to be written, beyond the confirm timeout, before the link counts as stalled.
_SEND_GRACE = 5.0


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

    #: ``messaging.system`` of the relay's send spans (sqla_jobs.otel).
    system = "nats"

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
        self._replies: _Replies | None = None  # the subscription every publish's answer comes to
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
            self._js = self._nc.jetstream()
            replies = _Replies(self._nc.new_inbox() + ".")
            await self._nc.subscribe(replies.prefix + "*", cb=replies.answer)
            self._replies = replies
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
        nc, replies = self._nc, self._replies
        if nc is None or replies is None or not nc.is_connected:
            raise BrokerUnavailable("not connected to NATS")
        outcome: dict[int, str | None] = {}
        limit = nc.max_payload
        batch = _Batch()
        subjects: dict[str, str] = {}  # by kind, for this batch: a route costs a lookup and a format

        abandoned = False

        async def send() -> None:
            for m in messages:
                if abandoned:
                    return
                headers = {"Nats-Msg-Id": m.headers[HEADER_ID], **m.headers}
                if len(m.body) + _HEADER_ROOM > limit and _wire_size(m.body, headers) > limit:
                    # nats-py checks the body only; the server closes the whole connection for a message
                    # whose body and headers exceed max_payload, which would cost the batch a reconnect.
                    outcome[m.job.id] = (f"the message ({len(m.body)} bytes of payload plus headers) is larger "
                                         f"than the NATS server's max_payload ({limit} bytes)")
                    continue
                kind = m.job.kind
                subject = subjects.get(kind)
                if subject is None:
                    subject = subjects[kind] = self.route(kind) or ""
                reply = replies.expect(batch, m.job.id)
                try:
                    await nc.publish(subject, m.body, reply=reply, headers=headers)
                except nats.errors.MaxPayloadError:
                    replies.forget_one(batch, reply)
                    outcome[m.job.id] = "the message is larger than the NATS server's max_payload"
        # Bounded: nats-py's publish waits for its flusher when its buffer is full, and a peer that stops reading
        # (a stalled link, not a reset one) would hold the batch, its jobs leased and renewed, for ever. Not
        # asyncio.wait_for: that waits for the cancelled publish to end, and nats-py's flush swallows the cancel.
        sending = asyncio.ensure_future(send())
        written, _ = await asyncio.wait({sending}, timeout=timeout + _SEND_GRACE)
        if not written:
            abandoned = True
            sending.cancel()
            replies.forget(batch)
            raise BrokerUnavailable(f"NATS publish stalled: the batch was not written within "
                                    f"{timeout + _SEND_GRACE:g} s")
        try:
            sending.result()
        except nats.errors.Error as exc:  # closed, or cut while writing: nothing of the batch counts
            replies.forget(batch)
            raise BrokerUnavailable(f"NATS publish failed: {exc!r}") from exc
        await _answers(batch, replies, self._lost, timeout)
        for m in messages:
            if m.job.id in outcome:
                continue
            verdict = batch.verdicts[m.job.id]
            if verdict is _NO_STREAM:
                outcome[m.job.id] = (f"no JetStream stream stores subject {self.route(m.job.kind)!r}: "
                                     "add it to a stream's subjects")
            elif isinstance(verdict, dict):
                if verdict.get("code") in _UNAVAILABLE:
                    raise BrokerUnavailable(f"NATS publish failed: JetStream answered {verdict!r}")
                outcome[m.job.id] = f"JetStream refused the message: {verdict!r}"
            else:
                outcome[m.job.id] = None
        return outcome

    async def close(self) -> None:
        nc, self._nc, self._js, self._lost, self._replies = self._nc, None, None, None, None
        if nc is not None:
            with contextlib.suppress(Exception):  # already cut: nothing left to close
                await asyncio.wait_for(nc.close(), 5)


class _Batch:
    """One ``publish`` call's messages awaiting JetStream's answer: each answer by job id, as it comes."""

    __slots__ = ("done", "subjects", "verdicts", "waiting")

    def __init__(self) -> None:
        self.verdicts: dict[int, Any] = {}  # None: stored; _NO_STREAM; or the error object JetStream sent
        self.subjects: list[str] = []
        self.waiting = 0
        self.done: asyncio.Future[None] | None = None  # set once waiting is 0, if someone awaits it


class _Replies:
    """One subscription to ``<inbox>.*`` for the answers of every publish in flight.

    Each message gets its own reply subject (``<inbox>.<n>``), which names the batch and the job the
    answer is for. nats-py's ``publish_async`` does the same with a future, a semaphore, a random token and
    a parsed ``PubAck`` per message, which was most of the relay's work for JetStream; here an answer is
    one dict lookup, and only an error is parsed.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._count = 0
        self._expected: dict[str, tuple[_Batch, int]] = {}

    def expect(self, batch: _Batch, job_id: int) -> str:
        """The reply subject of the next message of ``batch``, for job ``job_id``."""
        self._count += 1
        subject = f"{self.prefix}{self._count}"
        self._expected[subject] = (batch, job_id)
        batch.subjects.append(subject)
        batch.waiting += 1
        return subject

    def forget_one(self, batch: _Batch, subject: str) -> None:
        """A message that was not sent after all."""
        if self._expected.pop(subject, None) is not None:
            batch.waiting -= 1

    def forget(self, batch: _Batch) -> None:
        """A batch given up (cut, timed out): answers that still come are dropped."""
        for subject in batch.subjects:
            self._expected.pop(subject, None)

    async def answer(self, msg: Any) -> None:
        entry = self._expected.pop(msg.subject, None)
        if entry is None:  # for a batch given up, or a second answer to one message
            return
        batch, job_id = entry
        batch.verdicts[job_id] = _verdict(msg)
        batch.waiting -= 1
        if batch.waiting == 0 and batch.done is not None and not batch.done.done():
            batch.done.set_result(None)


def _verdict(msg: Any) -> Any:
    """None if JetStream stored the message (a ``PubAck``, or a duplicate of one), else why not."""
    headers = msg.headers
    if headers and headers.get("Status") == "503":
        return _NO_STREAM
    data = msg.data
    if b'"error"' not in data:  # every PubAck (its stream's name may hold the word: parsed below)
        return None
    try:
        return json.loads(data).get("error") or None
    except ValueError:
        return {"description": f"an answer that is not JSON: {data[:200]!r}"}


async def _answers(batch: _Batch, replies: _Replies, lost: asyncio.Event | None, timeout: float) -> None:
    """Wait until every message of ``batch`` has its answer; ``BrokerUnavailable`` if the connection closed
    first or they did not all come within ``timeout`` (then none of the batch counts as delivered)."""
    if not batch.waiting:
        return
    done = batch.done = asyncio.get_running_loop().create_future()
    closed = asyncio.ensure_future(lost.wait()) if lost is not None else None
    try:
        await asyncio.wait([done] if closed is None else [done, closed], timeout=timeout,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        if closed is not None:
            closed.cancel()
    if done.done():
        return
    done.cancel()
    missing = batch.waiting
    replies.forget(batch)
    if lost is not None and lost.is_set():
        raise BrokerUnavailable(f"the NATS connection closed with {missing} message(s) awaiting JetStream's ack")
    raise BrokerUnavailable(f"JetStream did not acknowledge {missing} message(s) within {timeout:g}s")


def _wire_size(body: bytes, headers: dict[str, str]) -> int:
    """What the server counts against max_payload: the header block (``NATS/1.0``, one line per
    header, a blank line) plus the body."""
    block = len("NATS/1.0\r\n") + sum(len(k.encode()) + 2 + len(v.encode()) + 2 for k, v in headers.items()) + 2
    return block + len(body)
