"""What a history of finished jobs costs the default worker: empty table against ``--finished`` rows.

::

    python docs/bench/history_cost.py --url postgresql+psycopg://postgres@127.0.0.1:5432/test \\
        [--finished 5000000] [--jobs 20000] [--runs 5] [--samples 1000] [--modes plain,partitioned]
    python docs/bench/history_cost.py --private-cluster [...]   # a throwaway server, autovacuum on
        [--plain-storage autovacuum_vacuum_scale_factor=0 --plain-storage ...]

Run it from a checkout, with the Python environment that has sqla-jobs installed
(``pip install -e .``). Four tables, each in a scratch schema of its own: for each mode
(``plain``: ``create-tables``; ``partitioned``: ``create-tables --partitioned``) one left
empty and one holding ``--finished`` finished jobs (written on the server by
``docs/bench/partitioned.py``'s fill, finished 1 to 6 days ago), then ``VACUUM ANALYZE`` of
all four. Then ``--runs`` rounds; in each round every table gets, in turn:

1. drain: ``--jobs`` no-op jobs committed at once (COPY) and drained by one worker process
   with ``WorkerConfig``'s defaults (4 threads, a claim of up to 4, LISTEN, the leader
   election, 60 s lease, 2 ms flush), idle and listening before the commit: the drain of
   ``sqla-jobs bench`` (``sqla_jobs.bench.run.drain``), whose only other setting is a 0.5 s
   poll (the LISTEN wakes it); jobs/s from the commit until the last one is finished;
2. claim: ``--samples`` calls of the worker's hot statement (finish the previous job, claim
   one) on one autocommit connection (``partitioned.claim_latency``), p50 and p95.

The order alternates (round 1: plain empty, plain history, partitioned history, partitioned
empty; round 2 the reverse; ...), so a slow patch of a shared machine does not always fall on
the same table, and every table gets the same work: the empty one ends with the finished jobs
of the rounds (``runs x (jobs + samples)``), the other with those on top of ``--finished``.
The ratio history / empty is taken within each round (drain: jobs/s with history over jobs/s
empty; claim: p95 empty over p95 with history, so 1.0 is "no cost" and 0.8 is 20 % slower in
both) and its median printed beside the medians themselves. The load average is read at each
measurement and the machine's busy share over the whole run from ``/proc/stat``.

``--private-cluster``: instead of ``--url``, ``initdb`` a PostgreSQL into a temporary folder
(as the ``postgres`` OS user when run as root), start it on a free port with the server's
defaults and ``autovacuum = on`` (as users run it; the development machine's shared server has
it off), measure there, then stop it and delete the folder. ``--plain-storage NAME=VALUE`` sets a
storage parameter (``ALTER TABLE jobs SET (...)``) on both plain tables, e.g. autovacuum's thresholds
(a partitioned parent takes none). After each round the script also reads how many index buffers the
claim's walk of the pending index needs (``EXPLAIN (ANALYZE, BUFFERS)``) and, at the end, how often
each table was vacuumed and analysed. The schemas are dropped at the end.
Prints a table and, with ``--json PATH``, writes every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import pwd
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from partitioned import _fill, claim_latency  # beside this file: the same fill and claim statement
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL, make_url

from sqla_jobs.bench.run import drain, queue
from sqla_jobs.worker.config import WorkerConfig

STATES = ("empty", "history")


def _load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _cpu() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


# -- a private server, autovacuum on ------------------------------------------------------


def _bindir() -> Path:
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(candidate, "initdb").exists():
            return Path(candidate)
    found = shutil.which("initdb")
    if found is None:
        raise SystemExit("--private-cluster: no initdb under /usr/lib/postgresql/*/bin or on PATH")
    return Path(found).parent


@contextlib.contextmanager
def private_cluster() -> Iterator[str]:
    """The URL of a fresh PostgreSQL with default settings and autovacuum on; stopped and deleted afterwards."""
    bindir, folder = _bindir(), Path(tempfile.mkdtemp(prefix="sqla-jobs-history-"))
    as_postgres = os.geteuid() == 0  # PostgreSQL refuses to run as root
    if as_postgres:
        user = pwd.getpwnam("postgres")
        os.chown(folder, user.pw_uid, user.pw_gid)

    def run(tool: str, *args: str) -> None:
        cmd = [str(bindir / tool), *args]
        subprocess.run(["runuser", "-u", "postgres", "--", *cmd] if as_postgres else cmd,
                       check=True, capture_output=True, timeout=300, cwd=folder)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    data = folder / "data"
    try:
        run("initdb", "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8")
        run("pg_ctl", "-D", str(data), "-l", str(folder / "log"), "-w", "-t", "120", "-o",
            f"-p {port} -c listen_addresses=127.0.0.1 -k {folder} -c autovacuum=on", "start")
        try:
            yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
        finally:
            run("pg_ctl", "-D", str(data), "-m", "fast", "-w", "-t", "120", "stop")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- the four tables -------------------------------------------------------------------------


class Table:
    """One scratch schema: a jobs table in one mode, empty or with history."""

    def __init__(self, url: URL, mode: str, state: str) -> None:
        self.mode, self.state = mode, state
        self.schema = f"bench_hist_{mode[:4]}_{state}_{uuid.uuid4().hex[:6]}"
        self.url = url.update_query_dict({"options": f"-csearch_path={self.schema},public"})
        self.engine: Engine = create_engine(self.url, pool_size=10)
        self.drains: list[float] = []
        self.claims: list[tuple[float, float]] = []
        self.walks: list[int] = []

    def create(self, admin: Engine, finished: int, storage: dict[str, str]) -> None:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{self.schema}"'))
        queue.create_tables(self.engine, partitioned=self.mode == "partitioned")
        if storage and self.mode == "plain":  # a partitioned parent takes no storage parameters
            with self.engine.begin() as conn:
                queue.driver(conn).bench_storage(conn, storage)
        if self.state == "history":
            took = _fill(self.engine, finished, self.mode == "partitioned")  # ends with VACUUM ANALYZE
            print(f"{self.mode}: {finished:,} finished rows written in {took:.0f} s", file=sys.stderr, flush=True)
        else:
            with self.engine.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("VACUUM ANALYZE jobs"))

    def rows(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM jobs WHERE state = 'finished'")).scalar_one())

    def walk(self) -> int:
        """Index buffers the claim's walk of the pending index reads to find 4 jobs (the ``due`` step, not locked).

        Its only cost that grows between vacuums: each claimed job leaves a dead entry at the head of the index.
        """
        with self.engine.begin() as conn:
            conn.execute(text("INSERT INTO jobs (kind, payload) SELECT 'noop', '{}'::jsonb FROM generate_series(1, 4)"))
            conn.execute(text("SELECT set_config('enable_bitmapscan', 'off', true), "
                              "set_config('enable_seqscan', 'off', true)"))
            plan = conn.execute(text(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT id FROM jobs WHERE state = 'pending' "
                "AND run_at <= now() ORDER BY priority DESC, run_at, id LIMIT 4")).scalar_one()
            conn.execute(text("DELETE FROM jobs WHERE state = 'pending'"))
        return int(plan[0]["Plan"]["Shared Hit Blocks"] + plan[0]["Plan"]["Shared Read Blocks"])

    def vacuum_counts(self) -> dict[str, int]:
        """Vacuums and analyses of the table (its partitions summed) during the run, manual and automatic."""
        with self.engine.connect() as conn:
            row = conn.execute(text(
                "SELECT sum(vacuum_count), sum(autovacuum_count), sum(analyze_count), sum(autoanalyze_count) "
                "FROM pg_stat_user_tables WHERE schemaname = :schema"), {"schema": self.schema}).one()
        return dict(zip(("vacuum", "autovacuum", "analyze", "autoanalyze"), (int(v or 0) for v in row), strict=True))

    def drop(self, admin: Engine) -> None:
        self.engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))


def _round_order(tables: list[Table], round_no: int) -> list[Table]:
    """ABBA: plain empty, plain history, partitioned history, partitioned empty; reversed every other round."""
    pairs = [tables[i:i + 2] for i in range(0, len(tables), 2)]  # (empty, history) of each mode
    flat = [t for k, pair in enumerate(pairs) for t in (pair if k % 2 == 0 else pair[::-1])]
    return flat if round_no % 2 == 0 else flat[::-1]


def measure(url: URL, args: argparse.Namespace) -> dict[str, Any]:
    admin = create_engine(url)
    modes = args.modes.split(",")
    tables = [Table(url, mode, state) for mode in modes for state in STATES]
    loads: list[float] = []
    try:
        for table in tables:
            table.create(admin, args.finished, dict(kv.split("=", 1) for kv in args.plain_storage))
        with admin.connect() as conn:
            autovacuum = conn.execute(text("SHOW autovacuum")).scalar_one()
            version = conn.execute(text("SHOW server_version")).scalar_one()
        busy0, total0 = _cpu()
        for round_no in range(args.runs):
            for table in _round_order(tables, round_no):
                loads.append(_load())
                rate = drain(table.url, table.engine, args.jobs, WorkerConfig.concurrency, 1, None)[0]
                table.drains.append(rate)
                loads.append(_load())
                table.claims.append(claim_latency(table.engine, args.samples))
                table.walks.append(table.walk())
            print(f"round {round_no + 1}/{args.runs}: " + ", ".join(
                f"{t.mode} {t.state} {t.drains[-1]:,.0f} jobs/s, p50/p95 {t.claims[-1][0]:.2f}/{t.claims[-1][1]:.2f} ms"
                for t in tables) + f"; load {loads[-1]:.1f}", file=sys.stderr, flush=True)
        busy1, total1 = _cpu()
        for table in tables:  # every job the drains and claims enqueued ended finished
            expected = args.runs * (args.jobs + args.samples) + (args.finished if table.state == "history" else 0)
            assert table.rows() == expected, f"{table.schema}: {table.rows()} finished, expected {expected}"
        result: dict[str, Any] = {
            "server": {"version": version, "autovacuum": autovacuum},
            "settings": {k: v for k, v in vars(args).items() if k != "url"},
            "load": {"min": min(loads), "median": statistics.median(loads), "max": max(loads),
                     "busy_share": (busy1 - busy0) / max(total1 - total0, 1)},
            "modes": {},
        }
        for mode in modes:
            empty, history = (next(t for t in tables if t.mode == mode and t.state == s) for s in STATES)
            cells: dict[str, Any] = {}
            for t in (empty, history):
                cells[t.state] = {
                    "drain_runs": t.drains, "drain": statistics.median(t.drains),
                    "p50_runs": [c[0] for c in t.claims], "p50": statistics.median(c[0] for c in t.claims),
                    "p95_runs": [c[1] for c in t.claims], "p95": statistics.median(c[1] for c in t.claims),
                    "walk_runs": t.walks, "vacuums": t.vacuum_counts(),
                }
            drain_ratios = [h / e for h, e in zip(history.drains, empty.drains, strict=True)]
            p95_ratios = [e[1] / h[1] for h, e in zip(history.claims, empty.claims, strict=True)]
            cells["drain_ratio_runs"], cells["drain_ratio"] = drain_ratios, statistics.median(drain_ratios)
            cells["p95_ratio_runs"], cells["p95_ratio"] = p95_ratios, statistics.median(p95_ratios)
            result["modes"][mode] = cells
        return result
    finally:
        for table in tables:
            table.drop(admin)
        admin.dispose()


def _runs(values: list[float], fmt: str) -> str:
    return " · ".join(format(v, fmt) for v in values)


def report(result: dict[str, Any], finished: int) -> None:
    server, load = result["server"], result["load"]
    print(f"\nPostgreSQL {server['version']}, autovacuum {server['autovacuum']}; load average "
          f"{load['min']:.1f} to {load['max']:.1f} (median {load['median']:.1f}), "
          f"CPU busy {load['busy_share']:.0%}")
    print(f"| {'':<5} | figure | empty | {finished:,} finished | history / empty |\n|---|---|---|---|---|")
    for mode, c in result["modes"].items():
        e, h = c["empty"], c["history"]
        print(f"| {mode} | drain, jobs/s | {e['drain']:,.0f} ({_runs(e['drain_runs'], ',.0f')}) | "
              f"{h['drain']:,.0f} ({_runs(h['drain_runs'], ',.0f')}) | "
              f"{c['drain_ratio']:.2f} ({_runs(c['drain_ratio_runs'], '.2f')}) |")
        print(f"| {mode} | claim p50, ms | {e['p50']:.2f} ({_runs(e['p50_runs'], '.2f')}) | "
              f"{h['p50']:.2f} ({_runs(h['p50_runs'], '.2f')}) | |")
        print(f"| {mode} | claim p95, ms | {e['p95']:.2f} ({_runs(e['p95_runs'], '.2f')}) | "
              f"{h['p95']:.2f} ({_runs(h['p95_runs'], '.2f')}) | "
              f"{c['p95_ratio']:.2f} ({_runs(c['p95_ratio_runs'], '.2f')}) |")
    for mode, c in result["modes"].items():
        print(f"{mode}: buffers the claim's walk read after each round: empty {c['empty']['walk_runs']}, "
              f"history {c['history']['walk_runs']}")
        print(f"{mode}: vacuums during the run: empty {c['empty']['vacuums']}, history {c['history']['vacuums']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="the PostgreSQL to measure on (scratch schemas, dropped at the end)")
    where.add_argument("--private-cluster", action="store_true",
                       help="initdb a throwaway server with autovacuum on, measure there, remove it")
    parser.add_argument("--finished", type=int, default=5_000_000)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--modes", default="plain,partitioned")
    parser.add_argument("--plain-storage", action="append", default=[], metavar="NAME=VALUE",
                        help="a storage parameter of both plain tables (autovacuum_vacuum_scale_factor=0, ...)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    started = datetime.now(timezone.utc)
    with contextlib.ExitStack() as stack:
        raw = stack.enter_context(private_cluster()) if args.private_cluster else args.url
        url = make_url(raw.replace("postgresql://", "postgresql+psycopg://", 1))
        result = measure(url, args)
    result["started"], result["ended"] = started.isoformat(timespec="seconds"), datetime.now(
        timezone.utc).isoformat(timespec="seconds")
    result["where"] = "private cluster" if args.private_cluster else url.render_as_string(hide_password=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    report(result, args.finished)
    print(f"{result['started']} to {result['ended']}: {result['where']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
