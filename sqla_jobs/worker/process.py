"""One worker process, from its settings: what ``sqla-jobs worker`` runs, and each ``--processes`` child.

``WorkerProcess`` holds everything a worker process needs, already parsed and
checked (``WorkerConfig``), and pickles, so the supervisor hands it to a child
as it is instead of rebuilding a command line. ``run_worker_process`` imports
the app, opens the engine with the pool a worker needs, serves metrics if
asked and runs the ``Worker``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from .._app import JobQueue
from .._bootstrap import load_worker_app, make_async_engine, make_engine, sync_twin
from ..errors import ConfigError
from .async_worker import AsyncWorker
from .config import WorkerConfig
from .worker import Worker

__all__ = ["WorkerProcess", "freeze_startup_heap", "run_worker_process"]

log = logging.getLogger("sqla_jobs.worker")


@dataclass(frozen=True)
class WorkerProcess:
    app: str | None
    url: str | None  # as given (normalised by make_engine); with its password, for a child
    config: WorkerConfig
    burst: bool = False
    metrics_port: int | None = None
    metrics_addr: str = "0.0.0.0"
    log_level: str = "INFO"
    asynchronous: bool = False  # AsyncWorker on the URL's async driver (--async, or an async URL)


class _ForgivingStdout:
    """``sys.stdout`` for handlers: once its reader is gone (``sqla-jobs worker | head``), their ``print()``
    output goes nowhere (one warning) instead of failing every job with ``BrokenPipeError``."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _gone(self) -> None:
        os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())  # what is still buffered goes too
        log.warning("the worker's standard output was closed by its reader: handlers' output is discarded")

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def freeze_startup_heap() -> None:
    """Leave what start-up built (SQLAlchemy, the app, its models, the engine: some 80,000 objects) out of the
    garbage collector's rounds, in a process that is about to run jobs until it stops.

    A worker allocates a few objects per job, so the collector runs often, and each of its fuller rounds walked
    the whole start-up heap again: about a fifth of a worker's CPU on a drain of no-op jobs (docs/performance.md).
    Frozen (``gc.freeze``), those objects are never scanned; the collector looks only at what the running
    process allocates. Called only where sqla-jobs owns the process (``sqla-jobs worker``, ``relay``, the bench's
    workers), never by ``Worker.run``: in someone else's process the choice is theirs."""
    gc.collect()  # what is already garbage goes now, not into the frozen heap for good
    gc.freeze()


def run_worker_process(spec: WorkerProcess, engine: Engine | None = None) -> int:
    """Run one worker until it stops; its exit status."""
    queue = load_worker_app(spec.app)
    if sys.stdout is not None and not isinstance(sys.stdout, _ForgivingStdout):
        sys.stdout = _ForgivingStdout(sys.stdout)  # type: ignore[assignment]
    if spec.asynchronous:
        return asyncio.run(_run_async(spec, queue))
    if engine is None:
        engine = make_engine(spec.url, pool_size=spec.config.pool_size)
    worker = Worker._from_config(engine, queue, spec.config)
    _serve_metrics(spec, queue, engine)
    freeze_startup_heap()
    return worker.run(burst=spec.burst)


async def _run_async(spec: WorkerProcess, queue: JobQueue[Any, Any]) -> int:
    """The async worker on this process's event loop; the CLI's signals stop it gracefully."""
    engine = await make_async_engine(spec.url, pool_size=spec.config.pool_size)
    try:
        if spec.metrics_port is not None:  # the metrics server's thread reads through a sync engine
            _serve_metrics(spec, queue, make_engine(sync_twin(spec.url)))
        freeze_startup_heap()
        return await AsyncWorker._from_config(engine, queue, spec.config).run(burst=spec.burst, install_signals=True)
    finally:
        await engine.dispose()


def _serve_metrics(spec: WorkerProcess, queue: JobQueue[Any, Any], engine: Engine) -> None:
    if spec.metrics_port is None:
        return
    from ..metrics import QueueMetrics  # raises ConfigError naming the extra when it is missing

    try:
        QueueMetrics(queue, engine).serve(spec.metrics_port, spec.metrics_addr)
    except OSError as exc:
        raise ConfigError(f"--metrics-port {spec.metrics_port}: cannot listen on "
                          f"{spec.metrics_addr}:{spec.metrics_port} ({exc.strerror or exc})") from None
