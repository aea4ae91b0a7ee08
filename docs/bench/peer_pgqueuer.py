"""pgqueuer side of the comparison (runs in the scratch virtualenv that has pgqueuer and asyncpg).

::

    python docs/bench/peer_pgqueuer.py --dsn postgresql://... --schema scratch --drain 1x200,2x200

Installs pgqueuer's tables into ``--schema`` (selected through ``search_path``;
its NOTIFY channel is renamed after the schema so no other pgqueuer install
hears it), and measures, as jobs/s unless noted:

* ``single_enqueue``: ``queries.enqueue(entrypoint, payload)`` once per job
  (each call is its own transaction);
* ``bulk_enqueue``: one ``queries.enqueue([...], [...], [...])`` call of ``--jobs`` jobs;
* ``drain``: for each PROCESSESxBATCH setting, that many idle worker processes
  (``QueueManager.run(batch_size=BATCH)``, async no-op entrypoint), then
  ``--jobs`` jobs enqueued in one call; jobs / (time from that call returning
  until the queue table is empty);
* ``pickup_p50_ms`` / ``pickup_p95_ms``: one idle in-process worker, one job
  enqueued at a time, from ``enqueue`` returning (committed) to the entrypoint starting.

Prints one JSON line.
"""

from __future__ import annotations

import os
import sys

# pgqueuer reads its object names from the environment once, at first use: set them before importing it.
_schema = sys.argv[sys.argv.index("--schema") + 1] if "--schema" in sys.argv else "pgqueuer_bench"
os.environ.setdefault("PGQUEUER_CHANNEL", f"{_schema}_ch")

import asyncio  # noqa: E402
import multiprocessing as mp  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import asyncpg  # noqa: E402
from _child import base_parser, emit, log, parse_settings, percentile  # noqa: E402
from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager  # noqa: E402
from pgqueuer.domain.settings import db_settings  # noqa: E402

try:
    from importlib.metadata import version

    VERSION = version("pgqueuer")
except Exception:  # pragma: no cover - only for a label
    VERSION = "?"


async def connect(dsn: str, schema: str) -> asyncpg.Connection:
    return await asyncpg.connect(dsn, server_settings={"search_path": schema})


# -- worker processes -----------------------------------------------------------------


def _worker_main(dsn: str, schema: str, batch: int, ready: Any, handled: Any) -> None:
    asyncio.run(_worker(dsn, schema, batch, ready, handled))


async def _worker(dsn: str, schema: str, batch: int, ready: Any, handled: Any) -> None:
    conn = await connect(dsn, schema)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))

    @qm.entrypoint("noop")
    async def noop(job: Job) -> None:
        with handled.get_lock():
            handled.value += 1

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, qm.shutdown.set)
    ready.set()
    await qm.run(batch_size=batch)
    await conn.close()


# -- measurements ------------------------------------------------------------------------


async def clear(queries: Queries) -> None:
    await queries.clear_queue()


async def single_enqueue(queries: Queries, n: int) -> float:
    await clear(queries)
    start = time.perf_counter()
    for i in range(n):
        await queries.enqueue("noop", b'{"i": %d}' % i)
    return n / (time.perf_counter() - start)


async def bulk_enqueue(queries: Queries, n: int) -> float:
    await clear(queries)
    start = time.perf_counter()
    await queries.enqueue(["noop"] * n, [b'{"i": %d}' % i for i in range(n)], [0] * n)
    return n / (time.perf_counter() - start)


async def queue_left(conn: asyncpg.Connection) -> bool:
    """Whether a job is still queued (pgqueuer deletes a job when it is done): the drain's completion check.

    It stops at the first live row, like `sqla-jobs bench`'s; a count(*) read every queued row each 20 ms.
    """
    return bool(await conn.fetchval(f"SELECT EXISTS (SELECT FROM {db_settings().queue_table})"))


async def drain(dsn: str, schema: str, queries: Queries, n: int, processes: int, batch: int,
                timeout: float) -> float:
    await clear(queries)
    ctx = mp.get_context("spawn")
    handled = ctx.Value("q", 0)
    readies = [ctx.Event() for _ in range(processes)]
    procs = [ctx.Process(target=_worker_main, args=(dsn, schema, batch, r, handled)) for r in readies]
    for p in procs:
        p.start()
    watcher = await connect(dsn, schema)
    try:
        for r in readies:
            if not await asyncio.to_thread(r.wait, 60):
                raise RuntimeError("a pgqueuer worker did not start within 60 s")
        await asyncio.sleep(0.5)  # let them reach their idle wait, as `sqla-jobs bench` does
        await queries.enqueue(["noop"] * n, [b"{}"] * n, [0] * n)
        start = time.perf_counter()
        while await queue_left(watcher):
            if not all(p.is_alive() for p in procs):
                raise RuntimeError("a pgqueuer worker process died during the drain (see its traceback above)")
            if time.perf_counter() - start > timeout:
                raise TimeoutError(f"pgqueuer drain of {n} jobs did not finish within {timeout:.0f} s")
            await asyncio.sleep(0.02)
        elapsed = time.perf_counter() - start
    finally:
        await watcher.close()
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            await asyncio.to_thread(p.join, 30)
            if p.is_alive():
                p.kill()
                p.join()
    if handled.value != n:
        raise RuntimeError(f"pgqueuer ran {handled.value} handlers for {n} jobs")
    return n / elapsed


async def pickup_latency(dsn: str, schema: str, queries: Queries, samples: int) -> list[float]:
    await clear(queries)
    conn = await connect(dsn, schema)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))
    started: dict[int, float] = {}
    arrived = asyncio.Event()

    @qm.entrypoint("ping")
    async def ping(job: Job) -> None:
        started[int(job.payload or b"0")] = time.perf_counter()
        arrived.set()

    task = asyncio.create_task(qm.run(batch_size=10))
    await asyncio.sleep(1.0)
    latencies = []
    try:
        for i in range(samples):
            arrived.clear()
            await queries.enqueue("ping", str(i).encode())
            committed = time.perf_counter()
            await asyncio.wait_for(arrived.wait(), 10)
            latencies.append((started[i] - committed) * 1000)
            await asyncio.sleep(0.01)
    finally:
        qm.shutdown.set()
        await asyncio.wait_for(task, 30)
        await conn.close()
    return latencies


async def amain() -> None:
    p = base_parser("pgqueuer side of the sqla-jobs comparison")
    p.add_argument("--drain", default="1x200,2x200", help="PROCESSESxBATCH_SIZE settings to try (default 1x200,2x200)")
    args = p.parse_args()
    settings = parse_settings(args.drain)
    conn = await connect(args.dsn, args.schema)
    queries = Queries(AsyncpgDriver(conn))
    await queries.install()
    result: dict[str, Any] = {"system": f"pgqueuer {VERSION}"}
    log("pgqueuer: one enqueue per transaction")
    result["single_enqueue"] = await single_enqueue(queries, args.single_jobs)
    log("pgqueuer: bulk enqueue")
    result["bulk_enqueue"] = await bulk_enqueue(queries, args.jobs)
    result["drain"] = {}
    for processes, batch in settings:
        log(f"pgqueuer: drain, {processes} process(es), batch_size {batch}")
        result["drain"][f"{processes}x{batch}"] = await drain(
            args.dsn, args.schema, queries, args.jobs, processes, batch, args.drain_timeout
        )
    log("pgqueuer: pickup latency")
    lat = await pickup_latency(args.dsn, args.schema, queries, args.latency_samples)
    result["pickup_p50_ms"] = percentile(lat, 50)
    result["pickup_p95_ms"] = percentile(lat, 95)
    await conn.close()
    emit(result)


if __name__ == "__main__":
    asyncio.run(amain())
