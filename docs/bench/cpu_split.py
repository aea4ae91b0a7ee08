"""Where a drain's CPU goes: the ``sqla-jobs worker`` processes, as deployed, against the PostgreSQL server.

    python docs/bench/cpu_split.py --url postgresql+psycopg://postgres@127.0.0.1/test
        [--jobs 30000] [--processes 2] [--concurrency 64,256] [--log-level WARNING,INFO] [--runs 3]

For each setting it starts ``--processes`` worker processes through the command line (``sqla-jobs
--log-level L worker --concurrency C``, with their stderr thrown away), enqueues ``--jobs`` no-op jobs
with ``enqueue_many``, and waits until none is pending or running. It reads the CPU time (user +
system, from ``/proc``) of the workers and of every ``postgres`` process on this machine before and
after, and prints per setting the medians of: jobs/s, worker CPU per job, server CPU per job, and how
busy the machine's cores were. The server's figure counts every ``postgres`` process, so run it on
a machine where nothing else uses the server. Linux only (``/proc``).
docs/performance.md ("Short jobs: claim in large batches") shows what it printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from sqla_jobs.bench import run as bench

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU seconds of one process (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def server_cpu_seconds() -> dict[str, float]:
    """CPU seconds of every ``postgres`` process, by pid."""
    found: dict[str, float] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "comm").read_text().startswith("postgres"):
                    found[proc.name] = cpu_seconds(proc.name)
            except OSError:  # it ended while we looked
                pass
    return found


def server_cpu_since(before: dict[str, float]) -> float:
    """The server's CPU seconds since ``before``, per process: one that ended meanwhile takes its seconds with it
    (a total of totals went negative then), so the figure is a floor."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in server_cpu_seconds().items())


def one_drain(url: str, jobs: int, processes: int, concurrency: int, log_level: str) -> dict[str, float]:
    engine = create_engine(url)
    cli = [sys.executable, "-m", "sqla_jobs.cli", "--log-level", log_level, "worker", "--url", url,
           "--app", "sqla_jobs.bench.run:queue", "--concurrency", str(concurrency)]
    workers: list[subprocess.Popen[bytes]] = []
    try:
        bench._reset(engine)
        workers = [subprocess.Popen(cli, stderr=subprocess.DEVNULL) for _ in range(processes)]
        time.sleep(3)  # started, listening, idle
        for w in workers:
            if w.poll() is not None:
                raise SystemExit(f"a worker exited with {w.returncode} before the drain: {' '.join(cli)}")
        with Session(engine) as session, session.begin():
            bench.queue.enqueue_many(session, ({"kind": "noop", "payload": {}} for _ in range(jobs)))
        workers_before = sum(cpu_seconds(w.pid) for w in workers)
        server_before = server_cpu_seconds()
        start = time.perf_counter()
        while bench._any_unfinished(engine):
            time.sleep(0.02)
        elapsed = time.perf_counter() - start
        worker_cpu = sum(cpu_seconds(w.pid) for w in workers) - workers_before
        server_cpu = server_cpu_since(server_before)
        finished = bench._count_finished(engine)
        if finished != jobs:
            raise SystemExit(f"{finished} of {jobs} jobs finished")
        return {"rate": jobs / elapsed, "worker_us": worker_cpu / jobs * 1e6, "server_us": server_cpu / jobs * 1e6,
                "busy": (worker_cpu + server_cpu) / elapsed / (os.cpu_count() or 1)}
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(30)
        engine.dispose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="a PostgreSQL URL (a scratch schema is made and dropped)")
    p.add_argument("--jobs", type=int, default=30_000)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--concurrency", default="64,256", help="threads per worker process, comma-separated")
    p.add_argument("--log-level", default="WARNING", help="the workers' --log-level, comma-separated")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    settings = [(int(c), level) for c in args.concurrency.split(",") for level in args.log_level.split(",")]
    runs: dict[tuple[int, str], list[dict[str, float]]] = {s: [] for s in settings}
    with bench.scratch(make_url(args.url)) as url:
        rendered = url.render_as_string(hide_password=False)
        for _ in range(args.runs):  # settings take turns, so a slow patch of the machine falls on all
            for concurrency, level in settings:
                runs[concurrency, level].append(one_drain(rendered, args.jobs, args.processes, concurrency, level))
    print("| workers | log level | jobs/s | worker CPU µs/job | server CPU µs/job | cores busy |")
    print("|---|---|---:|---:|---:|---:|")
    for (concurrency, level), results in runs.items():
        med = {key: statistics.median(r[key] for r in results) for key in results[0]}
        print(f"| {args.processes}x{concurrency} | {level} | {med['rate']:,.0f} | {med['worker_us']:.1f} "
              f"| {med['server_us']:.1f} | {med['busy']:.0%} |")


if __name__ == "__main__":
    main()
