"""The bench's own processes: the worker processes it spawns, and how it stops.

A stop (Ctrl-C, SIGTERM) unwinds the bench like an error, so its context managers stop
the worker processes and remove the scratch (``stop_on_sigterm``). A bench killed with
SIGKILL runs no clean-up: each worker process it spawned watches for it to be gone and
stops itself (``watch_bench``), and the next bench drops the scratch no running bench
holds (each driver's ``bench_scratch``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine, create_engine

from .._app import JobQueue
from ..worker.config import WorkerConfig
from ..worker.process import freeze_startup_heap
from ..worker.supervisor import watch_parent
from ..worker.worker import Worker

__all__ = ["bench_polling", "bench_worker", "built", "run_when_ready", "spawned", "stop_on_sigterm", "watch_bench"]


def stop_on_sigterm() -> None:
    """A SIGTERM unwinds the bench as Ctrl-C does: its worker processes are stopped and its scratch schema
    or file removed on the way out (``sqla-jobs`` then exits 130). A second one while that clean-up runs is
    ignored, so that it finishes."""

    def interrupt(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def watch_bench() -> None:
    """Called first in each worker process the bench spawns: a bench killed with SIGKILL cannot stop its
    workers, so each stops itself (as on SIGTERM) once the bench is gone. Only sqla_jobs' warnings are logged
    from then on: the measured workers spend no time writing lines of progress."""
    logging.getLogger("sqla_jobs").setLevel(logging.WARNING)
    parent = mp.parent_process()
    if parent is not None and parent.pid is not None:
        threading.Thread(target=watch_parent, args=(parent.pid,), daemon=True, name="sqla-jobs-bench").start()


@contextlib.contextmanager
def spawned(processes: int, target: Any, arguments: Any) -> Iterator[list[Any]]:
    """``processes`` spawned processes running ``target(*arguments(ready))``, each setting its ``ready`` event
    once its worker is built; this yields once all are (or 60 s passed) and terminates them after."""
    ctx = mp.get_context("spawn")
    readies = [ctx.Event() for _ in range(processes)]
    procs = [ctx.Process(target=_watching, args=(target, *arguments(r))) for r in readies]
    for p in procs:
        p.start()
    try:
        for r in readies:
            r.wait(60)
        time.sleep(0.5)  # let them reach their idle wait
        yield procs
    finally:
        for p in procs:
            p.terminate()  # SIGTERM: graceful, nothing is running by now
        for p in procs:
            p.join(30)


def bench_worker(url: str, app: JobQueue[Any, Any], config: WorkerConfig) -> Worker:
    """The worker of a process the bench spawned: its engine's pool sized by ``config`` (as ``sqla-jobs worker``
    sizes it), its poll ``bench_polling``'s."""
    engine = create_engine(url, pool_size=config.pool_size)
    return Worker._from_config(engine, app, bench_polling(app, engine, config))


def bench_polling(app: JobQueue[Any, Any], engine: Engine, config: WorkerConfig) -> WorkerConfig:
    """``config`` with the bench's poll: 0.5 s where the database notifies (LISTEN wakes the worker; the poll
    is a safety net), else 20 ms: without a wake-up a worker finds new jobs only by polling."""
    return dataclasses.replace(config, poll_interval=0.5 if app.driver(engine).supports_listen else 0.02)


def run_when_ready(worker: Worker, ready: Any) -> None:
    """Run ``worker`` until SIGTERM (a graceful stop), telling the bench through ``ready`` once it is built."""
    built(ready)
    worker.run()


def built(ready: Any) -> None:
    """A bench worker is built: its start-up heap frozen, as `sqla-jobs worker` does, and the bench told."""
    freeze_startup_heap()
    ready.set()


def _watching(target: Any, *arguments: Any) -> None:
    watch_bench()
    target(*arguments)
