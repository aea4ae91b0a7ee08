"""Durable handlers for the tests (sqla_jobs._durable), on the test app's queue: ``--app tests.durable_app:queue``.

Each step records an ``effects`` row (``step-<name>``) when its function really runs, so a test
counts how often each side effect happened; ``tx`` steps write theirs through the transactional
handler's session (exactly once with the checkpoint). A payload's ``kill_at`` names a point
(``step-<name>``: in the step, its effect written and its checkpoint not; ``after-<name>``: just
after the step returned) where the worker process kills itself with SIGKILL, once per job: the
first time, it leaves a file named after the job in the folder ``SQLA_JOBS_TEST_KILL_DIR``.
"""

from __future__ import annotations

import asyncio
import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import insert

from sqla_jobs import current_job
from tests.app import Effect, queue, record

__all__ = ["queue"]


def effect(name: str) -> str:
    record(f"step-{name}")
    _maybe_die(f"step-{name}")
    return name


def _maybe_die(at: str) -> None:
    job = current_job()
    if job.payload.get("kill_at") != at:
        return
    marker = Path(os.environ["SQLA_JOBS_TEST_KILL_DIR"]) / str(job.id)
    if not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


@queue.handler("d_steps")
def steps(payload: dict[str, Any]) -> list[Any]:
    """``n`` steps; step ``fail_at`` raises on its first attempt (a retry keeps the steps before it)."""
    job = current_job()
    done = []
    for i in range(payload.get("n", 5)):
        if payload.get("fail_at") == i and job.attempt == 1:
            job.step(f"s{i}", _raise)
        done.append(job.step(f"s{i}", effect, f"s{i}"))
        _maybe_die(f"after-s{i}")
    return done


def _raise() -> None:
    raise RuntimeError("the step failed")


@queue.handler("d_sleep")
def sleeper(payload: dict[str, Any]) -> str:
    job = current_job()
    job.step("before", effect, "before")
    job.sleep(timedelta(seconds=payload["seconds"]))
    job.step("after", effect, "after")
    return "woke"


@queue.handler("d_wait")
def waiter(payload: dict[str, Any]) -> Any:
    job = current_job()
    job.step("before", effect, "before")
    data = job.wait_for_event(payload["key"], timeout=payload.get("timeout", 3600))
    job.step("after", effect, "after")
    return {"data": data}


@queue.handler("d_tx", transactional=True)
def transactional(payload: dict[str, Any]) -> Any:
    """Steps whose effect rows go through the job's session: each commits with its checkpoint."""
    job = current_job()
    session = job.session
    assert session is not None

    def write(name: str) -> str:
        session.execute(insert(Effect).values(job_id=job.id, attempt=job.attempt, event=f"step-{name}",
                                              pid=os.getpid()))
        _maybe_die(f"step-{name}")
        return name

    job.step("t0", write, "t0")
    _maybe_die("after-t0")
    if payload.get("key"):
        job.wait_for_event(payload["key"], timeout=3600)
    if payload.get("seconds") is not None:
        job.sleep(payload["seconds"])
    for i in range(1, payload.get("n", 2)):
        job.step(f"t{i}", write, f"t{i}")
        _maybe_die(f"after-t{i}")
    return "done"


@queue.handler("d_async_wait")
async def async_waiter(payload: dict[str, Any]) -> Any:
    job = current_job()
    await job.step_async("before", _async_effect, "before")
    data = await job.wait_for_event_async(payload["key"], timeout=payload.get("timeout", 3600))
    await job.sleep_async(payload.get("seconds", 0))
    await job.step_async("after", _async_effect, "after")
    return {"data": data}


async def _async_effect(name: str) -> str:
    return await asyncio.to_thread(effect, name)  # its kill, if the payload names it, from that thread


@queue.handler("d_async_steps")
async def async_steps(payload: dict[str, Any]) -> list[Any]:
    """``d_steps`` as an ``async def`` handler: ``n`` steps through ``step_async``."""
    job = current_job()
    done = []
    for i in range(payload.get("n", 5)):
        done.append(await job.step_async(f"s{i}", _async_effect, f"s{i}"))
        _maybe_die(f"after-s{i}")
    return done


@queue.handler("d_async_tx", transactional=True)
async def async_transactional(payload: dict[str, Any]) -> str:
    """``d_tx``'s steps as an ``async def`` transactional handler: each effect row goes through its AsyncSession."""
    job = current_job()
    session = job.session
    assert session is not None

    async def write(name: str) -> str:
        await session.execute(insert(Effect).values(job_id=job.id, attempt=job.attempt, event=f"step-{name}",
                                                    pid=os.getpid()))
        _maybe_die(f"step-{name}")
        return name

    for i in range(payload.get("n", 2)):
        await job.step_async(f"t{i}", write, f"t{i}")
        _maybe_die(f"after-t{i}")
    return "done"


@queue.handler("d_twice")
def twice(payload: dict[str, Any]) -> None:
    job = current_job()
    job.step("same", lambda: 1)
    job.step("same", lambda: 2)


@queue.handler("d_bad_value")
def bad_value(payload: dict[str, Any]) -> None:
    current_job().step("bad", lambda: {"not json": object()})
