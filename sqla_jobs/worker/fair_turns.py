"""A worker's turn when fair queues (``sqla_jobs._fair``) are among the queues it claims from.

Each fair queue has a claim of its own (``Driver.claim_fair``), with this worker's cursor in its ring of keys
(the last key it served; each worker keeps its own, so no claimer writes a shared row); the other queues have
the plain claim, which leaves the fair queues out (``Driver.skipping_queues``). They take turns at going first,
so that none of them starves the others of the worker's free threads. The first claim of the turn also
finishes the previous batch, in the same round trip (``finish_and_claim`` / ``finish_and_claim_fair``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from sqlalchemy import Connection

from .._fair import FairQueue
from ..drivers.base import Claimed, Driver
from .executor import Outcome

__all__ = ["fair_turns"]


class _Store(Protocol):
    """What a fair turn needs of ``worker.store.Store``."""

    driver: Driver
    worker_name: str
    lease: float
    limited_kinds: list[str]
    fair: Mapping[str, FairQueue]
    cursors: dict[str, str]
    fair_turn: int

    def hot(self) -> AbstractContextManager[Connection]: ...

    def finish_and_claim_plain(self, ok: list[Outcome], limit: int, token: str, alone: bool,
                               queues: Sequence[str] | None, plain: bool) -> tuple[list[Claimed], bool, bool]: ...

    def report_finished(self, ok: list[Outcome], kept: set[int]) -> None: ...


def _rotated(order: list[Any], turn: int) -> Iterator[Any]:
    shift = turn % len(order)
    yield from order[shift:] + order[:shift]


def fair_turns(store: _Store, fair: list[str], ok: list[Outcome], limit: int, token: str, alone: bool,
               queues: Sequence[str] | None, plain: bool) -> tuple[list[Claimed], bool, bool]:
    """``Store.finish_and_claim`` with the fair queues ``fair`` among ``queues`` (see the module docstring).

    The plain claim (None in the order) is left out while ``plain`` says the other queues were found empty
    lately: on a queue table whose pending jobs are mostly the fair queues', it walks past them all.
    """
    others = plain and (queues is None or bool(set(queues) - set(fair)))
    # The kinds with limits are left out of the fair claims (``skip_kinds``) and claimed under their limits by
    # the plain turn, in every queue the worker serves: so it comes each time, without its ordinary claim when
    # there are no other queues (a worker of fair queues alone never claimed them: they waited for ever).
    limited = store.limited_kinds
    store.fair_turn += 1
    jobs: list[Claimed] = []
    waiting = short = False
    for name in _rotated([*fair, *([None] if others or limited else [])], store.fair_turn):
        free = limit - len(jobs)
        if free <= 0 or waiting or (jobs and jobs[0].isolated):
            break
        if name is None:
            got, left, others_short = store.finish_and_claim_plain(ok, free, token, alone and not jobs, queues, others)
            short = others and (others_short or len(got) < free)
        else:
            spec = store.fair[name]
            with store.hot() as conn:
                kept, got, left, store.cursors[name] = store.driver.finish_and_claim_fair(
                    conn, [o.job.fence for o in ok], name, spec.weights, store.cursors[name], free,
                    store.worker_name, token, store.lease, alone and not jobs, store.limited_kinds)
            if ok:
                store.report_finished(ok, kept)
        ok = []
        jobs += got
        waiting = waiting or left
    if ok:  # no claim was made: the finish alone
        store.finish_and_claim_plain(ok, 0, token, alone, queues, plain)
    return jobs, waiting, short
