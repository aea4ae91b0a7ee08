"""``RelayCounts``: what a relay did since it started (its executor and store count, ``Relay.run`` returns it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RelayCounts"]


@dataclass
class RelayCounts:
    """What a relay did since it started."""

    published: int = 0  #: jobs the broker acknowledged and the relay finished
    refused: int = 0  #: messages the broker refused (unroutable, nacked, no stream): failed attempts
    unrouted: int = 0  #: jobs of a kind the target has no route for: failed attempts
    interrupted: int = 0  #: jobs released because the broker went away while they were in flight
    reaped: int = 0  #: jobs of a dead relay handed back by this one's reaper
    reconnects: int = 0  #: connections to the broker made after the first
