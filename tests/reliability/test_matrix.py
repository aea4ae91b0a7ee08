"""Every fault scenario on every configuration, as one parametrised suite (issue 32, point 5).

A cell is one scenario (tests/reliability/matrix.py: ``SCENARIOS``) on one configuration: the threaded
or the async worker, on SQLite, PostgreSQL, PostgreSQL with a partitioned jobs table, MariaDB, or
PostgreSQL behind PgBouncer in transaction mode. Each cell drains 96 ``span`` jobs (a quarter of a second
each, logging when they run) and 24 transactional ``once_slow`` jobs through three worker processes while
its faults strike, then measures what came of it (lost, run twice, overlapping, misreported, wrongly
charged, recovery) and fails on any of the first five. With ``SQLA_JOBS_MATRIX_REPORT=FILE`` each cell adds
its report to FILE; ``python -m tests.reliability.matrix FILE`` prints the table in docs/guarantees.md.

Where the matrix stops: server restarts and the silent partition need a server of their own or a proxy
in front of one, so they run on PostgreSQL in test_outage.py, test_recovery.py and test_fencing.py
(both workers); the relay's kills and broker cuts run for both brokers in tests/relay/; poison under
``--processes`` runs on every backend in test_poison.py.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, insert, make_url, text
from sqlalchemy.pool import NullPool

from tests import app
from tests.conftest import make_database
from tests.pgbouncer import running_pgbouncer

from .conftest import Workers
from .harness import FAST, WorkerProc, enqueue, kill_tcp_connections, states, terminate_backends, wait_for
from .matrix import (
    COLUMNS,
    CONFIGURATIONS,
    FLAVOURS,
    NOT_APPLICABLE,
    SCENARIOS,
    Report,
    Span,
    measure,
    read_spans,
    save,
)

pytestmark = pytest.mark.slow

SPANS, ONCE, PROCESSES, FAULTS, FAULT_EVERY = 96, 24, 3, 3, 0.6
SPAN_SECONDS = 0.25


@dataclass
class Target:
    """Where a cell's workers run: their URL and options, an engine for the test's own reads, and how to cut
    every connection of given worker processes (None where there are none to cut)."""

    configuration: str
    url: str
    engine: Engine
    options: dict[str, object] = field(default_factory=dict)
    cut: Callable[[list[int]], int] | None = None


def _pg_cut(engine: Engine) -> Callable[[list[int]], int]:
    return lambda pids: sum(terminate_backends(engine, pid) for pid in pids)


def _mariadb_cut(schema: str) -> Callable[[list[int]], int]:
    return lambda pids: kill_tcp_connections(schema)  # the cell's own database: only its workers use it


def _bouncer_cut(direct: str) -> Callable[[list[int]], int]:
    """Behind PgBouncer: every server connection to the cell's own database (PgBouncer's, so no worker's
    name), the test's own excepted."""
    name = make_url(direct).database

    def cut(pids: list[int]) -> int:
        engine = create_engine(direct, poolclass=NullPool)
        try:
            with engine.begin() as conn:
                return len(conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                             "WHERE datname = :name AND pid <> pg_backend_pid()"),
                                        {"name": name}).all())
        finally:
            engine.dispose()
    return cut


def _tables(engine: Engine, partitioned: bool = False) -> None:
    app.queue.create_tables(engine, partitioned=partitioned)
    app.Base.metadata.create_all(engine)


@pytest.fixture
def target(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Target]:
    app._engine = None  # the handlers' engine follows SQLA_JOBS_URL
    try:
        yield from _targets(str(request.param), tmp_path, monkeypatch)
    finally:
        if app._engine is not None:
            app._engine.dispose()
            app._engine = None


def _targets(configuration: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Target]:
    if configuration == "pgbouncer":
        with running_pgbouncer() as (through, direct):
            engine = create_engine(direct, poolclass=NullPool)
            _tables(engine)
            # transaction mode: nothing prepared, no LISTEN (docs/howto/backends.md)
            url = make_url(through).update_query_dict({"prepare_threshold": "none"}).render_as_string(
                hide_password=False)
            monkeypatch.setenv("SQLA_JOBS_URL", url)
            yield Target(configuration, url, engine, {"no_listen": True}, _bouncer_cut(direct))
            engine.dispose()
        return
    for db in make_database(configuration, tmp_path):
        engine = create_engine(db.url, poolclass=NullPool)  # a cut never leaves the test a dead pooled connection
        _tables(engine, db.partitioned)
        monkeypatch.setenv("SQLA_JOBS_URL", db.url)
        cut = {"sqlite": None, "mariadb": _mariadb_cut(str(db.schema))}.get(configuration, _pg_cut(engine))
        yield Target(configuration, db.url, engine, cut=cut)
        engine.dispose()


class Fleet:
    """The cell's worker processes: a replacement starts for each one a fault takes away."""

    def __init__(self, target: Target, workers: Workers, lease: float) -> None:
        self.target, self.workers, self.lease = target, workers, lease
        self.live: list[WorkerProc] = []
        self.died: dict[int, float] = {}
        self.frozen: dict[int, list[tuple[float, float]]] = {}
        for _ in range(PROCESSES):
            self.start()

    def start(self) -> WorkerProc:
        worker = self.workers(self.target.url, concurrency=4, lease=self.lease, **self.target.options)
        self.live.append(worker)
        return worker

    def kill(self, rng: random.Random) -> None:
        worker = rng.choice(self.live)
        worker.signal(signal.SIGKILL)
        self.died[worker.pid] = time.time()
        worker.wait(10)
        self.live.remove(worker)
        self.start()

    def terminate(self, rng: random.Random) -> None:
        worker = rng.choice(self.live)
        code = worker.stop(timeout=FAST["grace"] + 10)
        assert code == 0, f"SIGTERM: worker {worker.pid} exited {code}: {worker.log()[-2000:]}"
        self.live.remove(worker)
        self.start()

    def freeze(self, spans: Path) -> float:
        """SIGSTOP a worker in the middle of a run, past its lease (2.5 leases), then SIGCONT it; returns when
        it stopped."""
        running = wait_for(lambda: [w for w in self.live if any(s.end is None and s.pid == w.pid
                                                                for s in read_spans(spans))],
                           30, "a worker running a job")
        worker = running[0]
        worker.signal(signal.SIGSTOP)
        stopped = time.time()
        time.sleep(2.5 * float(FAST["lease"]))
        worker.signal(signal.SIGCONT)
        self.frozen.setdefault(worker.pid, []).append((stopped, time.time()))
        return stopped

    def stop(self) -> None:
        for worker in self.live:
            code = worker.stop(timeout=FAST["grace"] + 10)
            assert code == 0, f"worker {worker.pid} exited {code}: {worker.log()[-2000:]}"


def _fuzzed(engine: Engine, rng: random.Random) -> list[int]:
    """Jobs no handler can take: unknown kinds, and ``span`` jobs whose payload is JSON of the wrong shape,
    written past enqueue's checks as a buggy producer or a hand-edited row would."""
    def value(depth: int = 0) -> object:
        choices: list[Callable[[], object]] = [
            lambda: rng.randint(-2**63, 2**63 - 1), lambda: rng.random() * 1e300, lambda: None, lambda: True,
            lambda: "".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0x400, 0x4ff), 0x1F600]))
                            for _ in range(rng.randint(0, 40)))]
        if depth < 4:
            choices += [lambda: [value(depth + 1) for _ in range(rng.randint(0, 4))],
                        lambda: {f"k{i}": value(depth + 1) for i in range(rng.randint(0, 4))}]
        return rng.choice(choices)()

    rows = [{"kind": f"no_such_kind_{i}", "payload": {"x": value()}} for i in range(6)]
    rows += [{"kind": "span", "payload": value()} for _ in range(6)]
    ids = []
    with engine.begin() as conn:
        for row in rows:  # one at a time: each row's id comes back
            result = conn.execute(insert(app.Job.__table__).values(**row, max_attempts=2))
            ids.append(int(result.inserted_primary_key[0]))
    return ids


@pytest.mark.parametrize(("target", "scenario"), [(c, s) for c in CONFIGURATIONS for s in SCENARIOS
                                                   if (s, c) not in NOT_APPLICABLE], indirect=["target"])
def test_every_scenario_on_every_configuration(scenario: str, target: Target, workers: Workers,
                                               tmp_path: Path) -> None:
    rng = random.Random(f"{scenario}-{target.configuration}-{workers.flavour}")
    spans = tmp_path / "spans.log"
    span_ids = enqueue(target.engine, workers.kind("span"), {"spans": str(spans), "sleep": SPAN_SECONDS}, n=SPANS,
                       max_attempts=20)
    once_ids = [enqueue(target.engine, workers.kind("once_slow"), {"marker": str(tmp_path / f"once-{i}"),
                                                                   "sleep": 0.05}, max_attempts=20)[0]
                for i in range(ONCE)]
    other_ids = _fuzzed(target.engine, rng) if scenario == "fuzz" else []
    # Only the kill and stale cells wait on a lease, so only they have the short one. Elsewhere a lease that
    # lapses is no fault of the cell's: a loaded 2-core CI box once kept a SQLite worker from its write lock
    # (busy transactional handlers, an unfair lock) past 2 s, and the lease did its job, charging a rerun.
    lease_bound = scenario in ("kill", "stale")
    fleet = Fleet(target, workers, lease=float(FAST["lease"]) if lease_bound else 10.0)
    faults: list[float] = []
    try:
        wait_for(lambda: spans.exists(), 60, "the first run to start")
        for _ in range(FAULTS if scenario in ("kill", "connections", "sigterm") else 1 if scenario == "stale"
                       else 0):
            time.sleep(FAULT_EVERY)
            if scenario == "kill":
                fleet.kill(rng)
            elif scenario == "connections":
                assert target.cut is not None
                assert target.cut([w.pid for w in fleet.live]) > 0, "no worker connection to cut"
            elif scenario == "sigterm":
                fleet.terminate(rng)
            else:
                stopped = fleet.freeze(spans)
                faults.append(stopped)
                continue
            faults.append(time.time())
        ids = span_ids + once_ids + other_ids
        wait_for(lambda: all(s in ("finished", "dead") for s in states(target.engine, ids).values())
                 and len(states(target.engine, ids)) == len(ids), 120, "every job to finish or die", interval=0.2)
        fleet.stop()
    finally:
        workers.kill_all()
    report = measure(Report(scenario, target.configuration, workers.flavour), target.engine, span_ids, once_ids,
                     other_ids, read_spans(spans), workers.logs(), faults, fleet.died, fleet.frozen,
                     charges_for_lost_runs=lease_bound, now=time.time())
    save(report, os.environ.get("SQLA_JOBS_MATRIX_REPORT"))
    print(f"\n{report}")
    assert report.clean(), f"{report.problems}\n{workers.all_logs()[-6000:]}"
    # A lost run waits out its lease, a frozen one the freeze (2.5 leases); then a claim and a quarter second.
    assert report.recovery_s <= 3 * float(FAST["lease"]) + 5, report
    bad = states(target.engine, other_ids)
    assert all(state == "dead" for state in bad.values()) and len(bad) == len(other_ids), bad


def test_the_matrix_covers_every_cell_and_the_docs_show_them() -> None:
    """Every scenario runs on every configuration but the cells that cannot apply, each with its reason, and
    docs/guarantees.md carries a row for each cell (``python -m tests.reliability.matrix`` writes them)."""
    assert set(NOT_APPLICABLE) <= {(s, c) for s in SCENARIOS for c in CONFIGURATIONS}
    assert all(NOT_APPLICABLE.values())
    doc = (Path(__file__).resolve().parents[2] / "docs" / "guarantees.md").read_text()
    assert "| configuration | worker | scenario | jobs | faults | " + " | ".join(COLUMNS) + " |" in doc
    for configuration in CONFIGURATIONS:
        for flavour in FLAVOURS:
            for scenario, title in SCENARIOS.items():
                assert f"| {configuration} | {flavour} | {title} |" in doc, (configuration, flavour, scenario)


def test_overlaps_are_measured_on_executing_time() -> None:
    """The measure itself: two runs overlapping in time overlap; a frozen run does not execute while frozen;
    a run whose process died ends at its death."""
    from .matrix import overlapping_jobs
    one, two = Span(1, 10, 0.0, 1.0), Span(1, 20, 0.5, 1.5)
    assert overlapping_jobs([one, two], {}, {}, 9.0) == [1]
    frozen = {10: [(0.2, 5.0)]}
    later = Span(1, 20, 1.0, 2.0)
    assert overlapping_jobs([Span(1, 10, 0.0, 5.1), later], {}, frozen, 9.0) == []
    assert overlapping_jobs([Span(1, 10, 0.0, None), later], {10: 0.9}, {}, 9.0) == []
    assert overlapping_jobs([Span(1, 10, 0.0, None), later], {}, {}, 9.0) == [1]
    # the job 26 the matrix once saw on SQLite: frozen at 0.614, its retry started at 5.365, resumed at 5.614
    retry = Span(26, 22327, 5.365, 5.615)
    assert overlapping_jobs([Span(26, 22326, 0.540, 5.6145), retry], {}, {22326: [(0.614, 5.614)]}, 9.0) == []
    # a stale run that goes on past the slack, while the retry still runs, does overlap
    longer = Span(26, 22327, 5.365, 5.8)
    assert overlapping_jobs([Span(26, 22326, 0.540, 5.9), longer], {}, {22326: [(0.614, 5.614)]}, 9.0) == [26]
