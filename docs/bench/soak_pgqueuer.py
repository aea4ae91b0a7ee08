"""pgqueuer's side of the soak (``compare.py --soak``): the same stream, measured the same way.

::

    python docs/bench/soak_pgqueuer.py --dsn postgresql://... --schema scratch --soak 120 --rate 2000 \\
        --processes 2 --batch-size 200

Runs in the scratch virtualenv that has pgqueuer and asyncpg. Like
``sqla-jobs bench --soak``: ``--processes`` idle worker processes
(``QueueManager.run(batch_size=...)``, an async entrypoint that records when it
started), then a producer that enqueues ``--rate`` jobs per second (one
``queries.enqueue`` of a list per 10 ms tick; ``--rate max``: 500 at a time, back
to back), and every ``--window`` seconds the queue table's pending count, size,
index size, dead tuples and autovacuum runs from ``pg_stat_user_tables``.
pgqueuer deletes a job from its queue table when it finishes (and logs it in
its log table), so no pruner runs here. Pickup is from the enqueue call
(commit included) to the entrypoint starting. Prints one JSON line with the
windows (the same fields as sqla-jobs' soak report) and the totals.
"""

from __future__ import annotations

import os
import sys

_schema = sys.argv[sys.argv.index("--schema") + 1] if "--schema" in sys.argv else "pgqueuer_bench"
os.environ.setdefault("PGQUEUER_CHANNEL", f"{_schema}_ch")  # before pgqueuer is imported: see peer_pgqueuer.py

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import queue as queue_module  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from _child import emit, log  # noqa: E402
from peer_pgqueuer import VERSION, connect  # noqa: E402
from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager  # noqa: E402
from pgqueuer.domain.settings import db_settings  # noqa: E402

TICK = 0.01
MAX_RATE_BATCH = 500
CATCH_UP_BATCH = 5_000


def _worker_main(dsn: str, schema: str, batch: int, ready: Any, starts: Any) -> None:
    asyncio.run(_worker(dsn, schema, batch, ready, starts))


async def _worker(dsn: str, schema: str, batch: int, ready: Any, starts: Any) -> None:
    conn = await connect(dsn, schema)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))
    seen: list[tuple[float, int, float]] = []

    @qm.entrypoint("soak")
    async def soak(job: Job) -> None:
        started = time.time()
        payload = json.loads(job.payload or b"{}")
        seen.append((started, payload["n"], started - payload["t"]))

    async def ship() -> None:
        while not qm.shutdown.is_set():
            await asyncio.sleep(0.5)
            if seen:
                starts.put(seen[:])
                seen.clear()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, qm.shutdown.set)
    shipper = asyncio.create_task(ship())
    ready.set()
    await qm.run(batch_size=batch)
    await shipper
    if seen:
        starts.put(seen[:])
    await conn.close()


class Tally:
    def __init__(self) -> None:
        self.enqueued: list[tuple[float, int]] = []
        self.sent = 0
        self.seen = bytearray()
        self.unique = 0
        self.duplicates = 0
        self.latency_by_window: dict[int, list[float]] = {}

    def record(self, chunk: list[tuple[float, int, float]], origin: float, window: float) -> None:
        for started, n, pickup in chunk:
            if n >= len(self.seen):
                self.seen.extend(bytes(max(n + 1 - len(self.seen), 65_536)))
            if self.seen[n]:
                self.duplicates += 1
            else:
                self.unique += 1
            self.seen[n] = 1
            self.latency_by_window.setdefault(int((started - origin) // window), []).append(pickup * 1000)


async def produce(queries: Queries, rate: float | None, tally: Tally, stop: asyncio.Event) -> None:
    start = time.perf_counter()
    while not stop.is_set():
        if rate is None:
            count = MAX_RATE_BATCH
        else:
            count = min(int(rate * (time.perf_counter() - start)) - tally.sent, CATCH_UP_BATCH)
            if count <= 0:
                await asyncio.sleep(TICK)
                continue
        stamp = time.time()
        first = tally.sent
        payloads = [json.dumps({"n": first + i, "t": stamp}).encode() for i in range(count)]
        await queries.enqueue(["soak"] * count, payloads, [0] * count)
        tally.enqueued.append((stamp, count))
        tally.sent += count


async def sample(conn: Any, phase: str) -> dict[str, Any]:
    table = db_settings().queue_table
    counts = dict(await conn.fetch(f"SELECT status::text, count(*) FROM {table} GROUP BY status"))
    row = await conn.fetchrow(
        "SELECT pg_relation_size(relid) AS table_bytes, pg_indexes_size(relid) AS index_bytes, "
        "n_live_tup AS live_tuples, n_dead_tup AS dead_tuples, "
        "n_tup_hot_upd::float8 / NULLIF(n_tup_upd, 0) AS hot_update_share, autovacuum_count, autoanalyze_count, "
        "vacuum_count, (current_setting('autovacuum') = 'on')::int AS autovacuum_on "
        "FROM pg_stat_user_tables WHERE relid = to_regclass($1)", table)
    figures = {k: float(v) for k, v in dict(row or {}).items() if v is not None}
    return {"phase": phase, "pending": int(counts.get("queued", 0)), "running": int(counts.get("picked", 0)),
            "figures": figures}


def percentile(values: list[float], p: int) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def windows(samples: list[dict[str, Any]], baseline: dict[str, float], tally: Tally, origin: float,
            width: float) -> list[dict[str, Any]]:
    enqueued: dict[int, int] = {}
    for stamp, count in tally.enqueued:
        index = int((stamp - origin) // width)
        enqueued[index] = enqueued.get(index, 0) + count
    out = []
    previous = baseline
    for index, s in enumerate(samples):
        f = s["figures"]
        lat = tally.latency_by_window.get(index, [])
        out.append({
            "start": index * width, "phase": s["phase"], "enqueued_per_s": enqueued.get(index, 0) / width,
            "run_per_s": len(lat) / width, "pickup_p50_ms": percentile(lat, 50),
            "pickup_p95_ms": percentile(lat, 95), "pickup_p99_ms": percentile(lat, 99),
            "pickup_max_ms": max(lat) if lat else None, "pending": s["pending"], "running": s["running"],
            "pruned_total": 0, "table_bytes": f.get("table_bytes"), "index_bytes": f.get("index_bytes"),
            "live_tuples": f.get("live_tuples"), "dead_tuples": f.get("dead_tuples"),
            "hot_update_share": f.get("hot_update_share"),
            "autovacuum_runs": f.get("autovacuum_count", 0) - previous.get("autovacuum_count", 0),
            "autoanalyze_runs": f.get("autoanalyze_count", 0) - previous.get("autoanalyze_count", 0),
            "vacuum_runs": f.get("vacuum_count", 0) - previous.get("vacuum_count", 0),
        })
        previous = f
    return out


async def amain() -> None:
    p = argparse.ArgumentParser(description="pgqueuer's side of the soak")
    p.add_argument("--dsn", required=True)
    p.add_argument("--schema", required=True)
    p.add_argument("--soak", type=float, required=True, help="seconds the producer runs")
    p.add_argument("--rate", default="1000", help="jobs per second, or 'max'")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=200)
    p.add_argument("--window", type=float, default=10.0)
    p.add_argument("--drain-timeout", type=float, default=120.0)
    p.add_argument("--vacuum-every", type=float, default=None,
                   help="VACUUM the queue table every this many seconds (as sqla-jobs' --soak-vacuum)")
    args = p.parse_args()
    rate = None if args.rate == "max" else float(args.rate)
    conn = await connect(args.dsn, args.schema)
    queries = Queries(AsyncpgDriver(conn))
    await queries.install()
    monitor = await connect(args.dsn, args.schema)

    ctx = mp.get_context("spawn")
    starts = ctx.Queue()
    readies = [ctx.Event() for _ in range(args.processes)]
    procs = [ctx.Process(target=_worker_main, args=(args.dsn, args.schema, args.batch_size, r, starts))
             for r in readies]
    for proc in procs:
        proc.start()
    for r in readies:
        if not await asyncio.to_thread(r.wait, 60):
            raise RuntimeError("a pgqueuer worker did not start within 60 s")
    await asyncio.sleep(0.5)
    tally = Tally()
    origin = time.time()
    stop_collecting = threading.Event()

    def collect() -> None:
        while True:
            try:
                tally.record(starts.get(timeout=0.2), origin, args.window)
            except queue_module.Empty:
                if stop_collecting.is_set():
                    return

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    baseline = (await sample(monitor, "soak"))["figures"]
    stop = asyncio.Event()
    producer = asyncio.create_task(produce(queries, rate, tally, stop))
    vacuums = 0

    async def vacuum() -> None:
        nonlocal vacuums
        vacuumer = await connect(args.dsn, args.schema)
        try:
            while True:
                await asyncio.sleep(args.vacuum_every)
                await vacuumer.execute(f"VACUUM {db_settings().queue_table}")
                vacuums += 1
        finally:
            await vacuumer.close()

    vacuum_task = asyncio.create_task(vacuum()) if args.vacuum_every else None
    samples: list[dict[str, Any]] = []
    drained_at = None
    index = 0
    try:
        while True:
            await asyncio.sleep(max(0.0, origin + (index + 1) * args.window - time.time()))
            elapsed = time.time() - origin
            phase = "soak" if index * args.window < args.soak - 1e-6 else "drain"
            if elapsed >= args.soak - 1e-6 and not stop.is_set():
                stop.set()
                await producer
            s = await sample(monitor, phase)
            samples.append(s)
            log(f"  {(index + 1) * args.window:6.0f}s {phase}: enqueued {tally.sent:,}, run {tally.unique:,}, "
                f"pending {s['pending']:,}, table {s['figures'].get('table_bytes', 0) / 1e6:.1f} MB")
            index += 1
            if stop.is_set():
                if s["pending"] == 0 and s["running"] == 0 and tally.unique == tally.sent:
                    drained_at = elapsed
                    break
                if elapsed > args.soak + args.drain_timeout:
                    log("pgqueuer did not drain the backlog within --drain-timeout")
                    break
    finally:
        stop.set()
        if vacuum_task:
            vacuum_task.cancel()
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        for proc in procs:
            await asyncio.to_thread(proc.join, 30)
            if proc.is_alive():
                proc.kill()
        await asyncio.sleep(0.6)
        stop_collecting.set()
        collector.join(10)
    last = await sample(monitor, "drain")
    await monitor.close()
    await conn.close()
    emit({
        "system": f"pgqueuer {VERSION}",
        "settings": {"seconds": args.soak, "rate": rate, "processes": args.processes, "batch_size": args.batch_size,
                     "window": args.window, "prune_after": None,
                     "vacuum_every": args.vacuum_every},
        "totals": {"enqueued": tally.sent, "run": tally.unique, "missing": tally.sent - tally.unique,
                   "duplicates": tally.duplicates, "pending_left": last["pending"], "running_left": last["running"],
                   "dead": 0, "pruned": 0, "soak_seconds": args.soak, "drained_after_seconds": drained_at,
                   "enqueue_rate": tally.sent / args.soak, "vacuums": vacuums,
                   "server_autovacuum": {1.0: "on", 0.0: "off"}.get(baseline.get("autovacuum_on", -1.0))},
        "windows": windows(samples, baseline, tally, origin, args.window),
    })


if __name__ == "__main__":
    asyncio.run(amain())
