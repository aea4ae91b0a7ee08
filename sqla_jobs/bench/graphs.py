"""``sqla-jobs bench --graphs``: what job graphs cost, each figure beside its peer measured in the same run.

::

    sqla-jobs bench --url postgresql+psycopg://user@host/db --graphs --fan-out 100000 --chain-length 10000

In the bench's scratch schema or file (``sqla_jobs.bench.run.scratch``), each ``--runs`` times, reporting
medians (``--graphs fan,chain,enqueue`` picks scenarios; all three by default):

* ``fan``: a root job, ``--fan-out`` N jobs that depend on it and a join that depends on all N, committed
  at once while ``--processes`` worker processes of ``--concurrency`` threads wait idle (the plain drain's
  workers and settings). Its rate is N + 2 jobs over the time from the first claim (the root's
  ``locked_at``) to the join's ``finished_at``, by the database clock. Its peer: the same workers draining
  N + 2 independent jobs, timed the same way (first ``locked_at`` to last ``finished_at``); the two take
  turns going first, and the ratio graph / plain is taken run by run (target >= 0.70). Where the graph's time
  went, from its rows (``fan_phases``): the seconds from the root's finish to its first dependent's claim (the
  root's transaction releases all N), and the N dependents' own drain rate from that claim to the last one's
  finish, beside the plain drain's (each batch of their finishes also counts the join down).
* ``chain``: ``--chain-length`` M jobs, each depending on the one before, run by one listening worker process
  (not a burst). A hop is a link's ``locked_at`` minus its upstream's ``finished_at``, by the database
  clock: p50 / p95 / p99 over the M - 1 hops (target p50 <= 5 ms on PostgreSQL). Its peer: the same
  worker running a chain of ``--latency-samples`` links made without ``depends_on``, each link's
  transactional handler adding the next one in the transaction that finishes it (``next`` in
  ``sqla_jobs.bench.app``), its hops timed the same way. Without LISTEN (SQLite, MariaDB) the worker
  polls every 20 ms, and both figures are mostly that.
* ``enqueue``: ``--jobs`` K jobs added through the ORM in one session and transaction, timed from building
  the objects to the commit: without dependencies (``add_all``), as a fan-in (K - 1 upstreams and a join
  depending on all of them, one ``add_all``) and as a chain (each job depending on the one before), the
  three taking turns going first; jobs/s, and the cost of each graph as its time over the plain one's
  (target <= 1.3), each graph in one ``add_all``, as a user writes it.
* ``batch``: ``--fan-out`` N jobs through ``queue.enqueue_many`` (COPY on PostgreSQL) in one transaction,
  as members of a new ``Batch`` with all three callbacks (N members, 3 callbacks, 3N edges) and without a
  batch, taking turns; jobs/s each, and the batch's cost as its time over the plain one's.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.orm import Session

from .._batch import Batch
from ..errors import ConfigError
from .app import BenchJob, queue
from .run import Figures, _any_unfinished, _pct, _reset, reachable, scratch, worker_processes

__all__ = ["SCENARIOS", "run_graphs"]

SCENARIOS = ("fan", "chain", "enqueue", "batch")
#: Seconds without a job finishing after which a drain is declared stuck: long, since one finish counts down
#: all of a fan-out's dependents in one statement (minutes for 100,000 on a table without statistics yet).
STALL = 900.0

FAN, PLAIN, FAN_RATIO = ("fan-out/fan-in 1 -> N -> 1 (jobs/s)", "plain drain of N + 2 jobs (jobs/s)",
                         "fan-out/fan-in vs plain drain (target >= 0.70)")
#: Where the fan-out's time goes: the root's release of its N dependents, then their drain beside the plain one.
FAN_RELEASE, FAN_MIDDLE, FAN_MIDDLE_RATIO = ("fan: root's finish -> first dependent's claim (s)",
                                             "fan: the N dependents' drain (jobs/s)",
                                             "fan: the N dependents' drain vs plain drain")
ENQ_NONE, ENQ_FAN, ENQ_CHAIN = ("enqueue without dependencies (jobs/s)", "enqueue fan-in K-1 -> 1 (jobs/s)",
                                "enqueue chain of K (jobs/s)")
BATCH, BATCH_PLAIN, BATCH_COST = ("enqueue_many N as a batch, 3 callbacks (jobs/s)",
                                 "enqueue_many N, no batch (jobs/s)", "batch enqueue_many cost vs none")
COST_FAN, COST_CHAIN = ("fan-in enqueue cost vs none (target <= 1.3)",
                        "chain enqueue cost vs none (target <= 1.3)")


def scenarios(raw: str) -> tuple[str, ...]:
    """``--graphs fan,chain`` as the scenarios to run, in their fixed order."""
    asked = {part.strip() for part in raw.split(",") if part.strip()}
    unknown = asked - set(SCENARIOS)
    if unknown or not asked:
        raise ConfigError(f"--graphs takes a comma-separated list of {', '.join(SCENARIOS)}, got {raw!r}")
    return tuple(s for s in SCENARIOS if s in asked)


def _check(args: argparse.Namespace) -> tuple[str, ...]:
    if args.soak is not None:
        raise ConfigError("--graphs and --soak are two different benches: give one")
    if args.discard_finished or args.finished_rows:
        raise ConfigError("--graphs times jobs by their finished rows: not with --discard-finished or --finished-rows")
    if args.fan_out < 1 or args.chain_length < 2 or args.jobs < 2 or args.latency_samples < 2:
        raise ConfigError("--graphs needs --fan-out >= 1, --chain-length >= 2, --jobs >= 2, --latency-samples >= 2")
    return scenarios(args.graphs)


# -- reading the clock of the rows ---------------------------------------------------------------------


def _state(engine: Engine, job_id: int) -> str | None:
    with engine.connect() as conn:
        return conn.execute(select(BenchJob.state).where(BenchJob.id == job_id)).scalar_one_or_none()


def _finished(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(BenchJob).where(BenchJob.state == "finished")).scalar_one()


def _span_rate(engine: Engine, n: int) -> float:
    """``n`` over the seconds from the first claim to the last finish, by the database clock; every job
    in the table (only the measured ones, after ``_reset``) must have finished."""
    with engine.connect() as conn:
        count, first, last = conn.execute(
            select(func.count(), func.min(BenchJob.locked_at), func.max(BenchJob.finished_at))
            .where(BenchJob.state == "finished")).one()
    if count != n:
        raise RuntimeError(f"{count} of {n} jobs finished")
    return n / max((last - first).total_seconds(), 1e-6)


def _clock(engine: Engine, first_id: int) -> dict[int, Any]:
    """(locked_at, finished_at) of the jobs from ``first_id`` on, by id."""
    t = BenchJob
    with engine.connect() as conn:
        rows = conn.execute(select(t.id, t.locked_at, t.finished_at).where(t.id >= first_id))
        return {r.id: r for r in rows}


def _wait(engine: Engine, done: Callable[[], bool], procs: list[Any], what: str, poll: float = 0.02) -> None:
    """Poll ``done`` until true; fail if a worker process died or no job finished for ``STALL`` seconds."""
    seen, moved, check = -1, time.monotonic(), 0.0
    while not done():
        now = time.monotonic()
        if now >= check:  # every 2 s: a count of the finished rows is not free on a large table
            check = now + 2.0
            if any(p.exitcode is not None for p in procs):
                raise RuntimeError(f"{what}: a worker process exited ({[p.exitcode for p in procs]})")
            finished = _finished(engine)
            if finished != seen:
                seen, moved = finished, now
            elif now - moved > STALL:
                raise RuntimeError(f"{what}: no job finished for {STALL:.0f} s ({finished} finished)")
        time.sleep(poll)


# -- the scenarios ---------------------------------------------------------------------------------------


def fan_graph(args: argparse.Namespace, url: Any, engine: Engine, kind: str, join: bool = True) -> float:
    """Jobs/s of a 1 -> N -> 1 graph, first claim to the join's finish (the module docstring); ``join=False``:
    the last job depends on the root alone, the graph without its join (docs/bench/fan_join_cost.py)."""
    n = args.fan_out
    with worker_processes(url, args.concurrency, args.processes, args.batch_size, args.use_async,
                          args.vacuum_dead_rows) as procs:
        with Session(engine, expire_on_commit=False) as session, session.begin():
            root = BenchJob(kind=kind, payload={})
            middle = [BenchJob(kind=kind, payload={"i": i}, depends_on=[root]) for i in range(n)]
            last = BenchJob(kind=kind, payload={}, depends_on=middle if join else [root])
            session.add_all([root, *middle, last])
        # The join finishes last. Without it, the graph is done when no job is pending or running: the root's
        # finish releases every dependent in its own transaction, so none is left blocked behind a finished one.
        done = (lambda: _state(engine, last.id) == "finished") if join else (lambda: not _any_unfinished(engine))
        _wait(engine, done, procs, "the graph")
    return _span_rate(engine, n + 2)


def fan_phases(engine: Engine) -> tuple[float, float]:
    """Where ``fan_graph``'s time went, read from its rows (the root has the lowest id, the join the highest):
    the seconds from the root's ``finished_at`` (its finishing transaction's start, where it releases its
    dependents) to the first dependent's claim, and the dependents' jobs/s from that claim to the last one's
    finish. The join's count-down is in the second: every batch of the dependents' finishes pays it."""
    t = BenchJob
    with engine.connect() as conn:
        root, join = conn.execute(select(func.min(t.id), func.max(t.id))).one()
        released = conn.execute(select(t.finished_at).where(t.id == root)).scalar_one()
        n, first, last = conn.execute(select(func.count(), func.min(t.locked_at), func.max(t.finished_at))
                                      .where(t.id > root, t.id < join)).one()
    return (first - released).total_seconds(), n / max((last - first).total_seconds(), 1e-6)


def plain_drain(args: argparse.Namespace, url: Any, engine: Engine, kind: str) -> float:
    """Jobs/s of N + 2 independent jobs on the same workers, timed as the graph is."""
    n = args.fan_out + 2
    with worker_processes(url, args.concurrency, args.processes, args.batch_size, args.use_async,
                          args.vacuum_dead_rows) as procs:
        with Session(engine) as session, session.begin():
            queue.enqueue_many(session, ({"kind": kind, "payload": {"i": i}} for i in range(n)))
        _wait(engine, lambda: not _any_unfinished(engine), procs, "the plain drain")
    return _span_rate(engine, n)


def add_chain(session: Session, kind: str, m: int) -> list[BenchJob]:
    """``m`` jobs, each depending on the one before, in one ``add_all``."""
    links: list[BenchJob] = []
    for i in range(m):
        links.append(BenchJob(kind=kind, payload={"i": i}, depends_on=links[-1:]))
    session.add_all(links)
    return links


def chain_hops(args: argparse.Namespace, url: Any, engine: Engine, kind: str) -> tuple[list[float], list[float]]:
    """Milliseconds of each hop of a chain made with ``depends_on``, and of one whose handlers add the next link."""
    relay = "async_next" if args.use_async else "next"
    m, peer = args.chain_length, args.latency_samples
    with worker_processes(url, args.concurrency, 1, args.batch_size, args.use_async) as procs:
        with Session(engine, expire_on_commit=False) as session, session.begin():
            links = add_chain(session, kind, m)
        ids = [link.id for link in links]
        _wait(engine, lambda: _state(engine, ids[-1]) == "finished", procs, "the chain")
        with Session(engine) as session, session.begin():
            session.add(BenchJob(kind=relay, payload={"left": peer}))
        _wait(engine, lambda: _finished(engine) == m + peer, procs, "the handlers' chain")
    rows = _clock(engine, ids[0])
    return _hops([rows[i] for i in ids]), _hops([rows[i] for i in sorted(rows) if i > ids[-1]])


def _hops(links: list[Any]) -> list[float]:
    """Each link's claim after its upstream's finish, in ms by the database clock."""
    return [(b.locked_at - a.finished_at).total_seconds() * 1000 for a, b in pairwise(links)]


def _enqueue_none(session: Session, kind: str, k: int) -> None:
    session.add_all([BenchJob(kind=kind, payload={"i": i}) for i in range(k)])


def _enqueue_fan_in(session: Session, kind: str, k: int) -> None:
    upstreams = [BenchJob(kind=kind, payload={"i": i}) for i in range(k - 1)]
    session.add_all([*upstreams, BenchJob(kind=kind, payload={}, depends_on=upstreams)])


def _enqueue_chain(session: Session, kind: str, k: int) -> None:
    add_chain(session, kind, k)


ENQUEUES = {ENQ_NONE: _enqueue_none, ENQ_FAN: _enqueue_fan_in, ENQ_CHAIN: _enqueue_chain}


def enqueue_rates(engine: Engine, kind: str, k: int, turn: int) -> dict[str, float]:
    """Jobs/s of adding ``k`` jobs each way, one transaction each; ``turn`` rotates which goes first."""
    names = list(ENQUEUES)
    rates = {}
    for name in names[turn % 3:] + names[:turn % 3]:
        _reset(engine)
        start = time.perf_counter()
        with Session(engine) as session, session.begin():
            ENQUEUES[name](session, kind, k)
        rates[name] = k / (time.perf_counter() - start)
    return rates


def batch_rates(engine: Engine, kind: str, n: int, turn: int) -> dict[str, float]:
    """Jobs/s of ``enqueue_many`` of ``n`` jobs as a new batch's members and without; ``turn`` picks the first."""
    rates = {}
    for name in ((BATCH, BATCH_PLAIN) if turn % 2 == 0 else (BATCH_PLAIN, BATCH)):
        _reset(engine)
        items = [{"kind": kind, "payload": {"i": i}} for i in range(n)]
        start = time.perf_counter()
        with Session(engine) as session, session.begin():
            batch = Batch(**{callback: BenchJob(kind=kind, payload={})
                             for callback in ("on_complete", "on_success", "on_failure")}) if name == BATCH else None
            queue.enqueue_many(session, items, batch=batch)
        rates[name] = n / (time.perf_counter() - start)
    return rates


# -- the run and its report ------------------------------------------------------------------------------


def run_graphs(args: argparse.Namespace) -> int:
    chosen = _check(args)
    url = reachable(args.url)
    kind = "async_noop" if args.use_async else "noop"
    if "fan" in chosen and args.runs % 2:
        # Which of the two goes first shows in their ratio (docs/performance.md, "How to read them").
        print(f"note: with --runs {args.runs} the fan-out goes first once more than its plain drain; "
              "an even --runs gives each order as often", file=sys.stderr, flush=True)
    figures = Figures()
    record = figures.record

    with scratch(url) as bench_url:
        engine = create_engine(bench_url, pool_size=10)
        if "enqueue" in chosen:  # warm up each way once (mappers, statement caches), untimed
            enqueue_rates(engine, kind, min(args.jobs, 200), 0)
        for run in range(args.runs):
            if "fan" in chosen:
                got: dict[str, float] = {}
                for name in ((FAN, PLAIN) if run % 2 == 0 else (PLAIN, FAN)):
                    _reset(engine)
                    got[name] = (fan_graph if name == FAN else plain_drain)(args, bench_url, engine, kind)
                    if name == FAN:  # read before the next _reset drops the graph's rows
                        got[FAN_RELEASE], got[FAN_MIDDLE] = fan_phases(engine)
                got[FAN_RATIO], got[FAN_MIDDLE_RATIO] = got[FAN] / got[PLAIN], got[FAN_MIDDLE] / got[PLAIN]
                for name in (FAN, PLAIN, FAN_RATIO, FAN_RELEASE, FAN_MIDDLE, FAN_MIDDLE_RATIO):
                    record(name, got[name])
            if "chain" in chosen:
                _reset(engine)
                hops, relayed = chain_hops(args, bench_url, engine, kind)
                for p in (50, 95, 99):
                    record(f"chain hop p{p} (ms)", _pct(hops, p))
                for p in (50, 95, 99):
                    record(f"peer: hop when a handler adds the next, p{p} (ms)", _pct(relayed, p))
            if "enqueue" in chosen:
                added = enqueue_rates(engine, kind, args.jobs, run)
                for name, rate in added.items():
                    record(name, rate)
                record(COST_FAN, added[ENQ_NONE] / added[ENQ_FAN])
                record(COST_CHAIN, added[ENQ_NONE] / added[ENQ_CHAIN])
            if "batch" in chosen:
                made = batch_rates(engine, kind, args.fan_out, run)
                for name, rate in made.items():
                    record(name, rate)
                record(BATCH_COST, made[BATCH_PLAIN] / made[BATCH])
            print(f"run {run + 1}/{args.runs} done", file=sys.stderr, flush=True)
        engine.dispose()
    summary = figures.medians()
    if args.json:
        figures.print_json(args, summary)
        return 0
    flavour = "async worker, async no-op handlers" if args.use_async else "threaded worker"
    sizes = {"fan": f"fan-out N = {args.fan_out:,} ({args.processes} process(es) x {args.concurrency} threads)",
             "chain": f"chain of {args.chain_length:,} (1 process x {args.concurrency} threads)",
             "enqueue": f"enqueue of K = {args.jobs:,}", "batch": f"batch of N = {args.fan_out:,}"}
    print(f"\nsqla-jobs bench --graphs on {url.get_backend_name()} ({flavour}): "
          f"{'; '.join(sizes[s] for s in chosen)}; median of {args.runs} run(s)")
    for name, value in summary.items():
        print(f"  {name:<53} {value:>12,.2f}")
    return 0
