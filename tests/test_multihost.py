"""Many worker hosts on one PostgreSQL, each in its own network namespace (tests/netns.py).

Every job runs once across hosts, and a host whose network link is cut in the
middle of a run loses its jobs for one lease only: the other hosts take them
over and go on. ``docs/bench/multihost.py`` measures drain by host count with
the same harness (docs/howto/scaling.md).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.orm import Session

from sqla_jobs.leader import leader_table
from tests import app, netns
from tests.conftest import IN_CI, ROOT, Database, make_database
from tests.reliability.matrix import Span, overlapping_jobs

# Recovery within a lease is a time bound, and the hosts drain at full speed: alone, after the parallel phase.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

LEASE, HEARTBEAT = 3.0, 0.5


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Database]:
    """A PostgreSQL schema with the test app's tables (the production backend, reached over TCP)."""
    missing = netns.problem()
    if missing:
        if IN_CI:
            pytest.fail(f"the multi-host tests must run in CI: {missing}")
        pytest.skip(missing)
    for database in make_database("postgresql", tmp_path):
        app.queue.create_tables(database.engine)
        app.Base.metadata.create_all(database.engine)
        yield database


def start_host(host: netns.Host, db: Database, *options: str) -> subprocess.Popen[str]:
    url = host.url(db.url)
    return host.popen(
        [sys.executable, "-m", "sqla_jobs.cli", "--log-level", "WARNING", "worker", "--app", "tests.app:queue",
         "--url", url, "--name", f"host{host.index}", *options],
        env=db.env(SQLA_JOBS_URL=url), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def stop(hosts: list[netns.Host]) -> None:
    for host in hosts:
        for proc in host.procs:
            proc.send_signal(signal.SIGTERM)  # `ip netns exec` passes it on to the worker it became
    for host in hosts:
        for proc in host.procs:
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            assert "Traceback" not in err, err


def wait_until_finished(db: Database, total: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with Session(db.engine) as session:
            done = session.scalar(select(func.count()).where(app.Job.state == "finished"))
        if done == total:
            return
        assert time.monotonic() < deadline, f"{done} of {total} jobs finished after {timeout:g}s"
        time.sleep(0.1)


def test_four_hosts_of_two_processes_run_every_job_exactly_once(pg: Database) -> None:
    jobs = 2000
    with netns.hosts(4) as hosts:
        for host in hosts:
            start_host(host, pg, "--processes", "2", "--concurrency", "4")
        with Session(pg.engine) as session, session.begin():
            session.add_all([app.Job(kind="once", payload={"sleep": 0.002}) for _ in range(jobs)])
        wait_until_finished(pg, jobs, timeout=180)
        stop(hosts)
    with Session(pg.engine) as session:
        ids = set(session.scalars(select(app.Job.id)))
        done = set(session.scalars(select(app.Once.job_id)))
        attempts = Counter(session.scalars(select(app.Job.attempts)))
        by_host = Counter(name.split(":")[0] for name in session.scalars(select(app.Job.locked_by)))
    assert done == ids and len(ids) == jobs  # the transactional handler's row: one commit per job
    assert attempts == {1: jobs}  # no run rolled back and retried
    assert len(by_host) >= 3, f"the jobs were not shared between hosts: {by_host}"


def test_a_host_cut_off_mid_run_loses_its_jobs_for_one_lease_only(pg: Database) -> None:
    jobs = 240  # 0.3 s each on 4 hosts x 4 threads: about 5 s of work
    timing = ("--concurrency", "4", "--lease", str(LEASE), "--heartbeat", str(HEARTBEAT))
    with netns.hosts(4) as hosts:
        for host in hosts:
            start_host(host, pg, *timing)
        with Session(pg.engine) as session, session.begin():
            session.add_all([app.Job(kind="once", payload={"sleep": 0.3}) for _ in range(jobs)])

        def held_by_host0() -> set[int]:
            with Session(pg.engine) as session:
                return set(session.scalars(select(app.Job.id).where(
                    app.Job.state == "running", app.Job.locked_by.like("host0%"))))

        deadline = time.monotonic() + 60
        while len(held_by_host0()) < 4:  # host 0 is busy: all four of its threads hold a job
            assert time.monotonic() < deadline, "host 0 never got to work"
            time.sleep(0.02)
        hosts[0].cut()
        cut_at = time.monotonic()
        stranded = held_by_host0()
        with Session(pg.engine) as session:
            finished_at_cut = session.scalar(select(func.count()).where(app.Job.state == "finished"))

        # The others go on at once, and take the stranded jobs over within a lease (plus a reaper pass).
        while True:
            with Session(pg.engine) as session:
                rows = session.execute(select(app.Job.id, app.Job.locked_by).where(app.Job.id.in_(stranded))).all()
                finished = session.scalar(select(func.count()).where(app.Job.state == "finished"))
            if all(not by.startswith("host0") for _, by in rows):
                break
            assert time.monotonic() - cut_at < LEASE + HEARTBEAT + 5, "the stranded jobs were not taken over"
            time.sleep(0.05)
        recovered_after = time.monotonic() - cut_at
        assert finished > finished_at_cut, "the other hosts stopped while host 0 was cut off"

        wait_until_finished(pg, jobs, timeout=120)
        hosts[0].kill()  # it cannot reach the database to shut down cleanly: as a dead host would be
        stop(hosts[1:])
    with Session(pg.engine) as session:
        ids = set(session.scalars(select(app.Job.id)))
        done = set(session.scalars(select(app.Once.job_id)))
        retried = {job.id: job for job in session.scalars(select(app.Job).where(app.Job.id.in_(stranded)))}
    assert done == ids  # every job committed once, the stranded ones by another host
    assert all(j.attempts == 2 and not j.locked_by.startswith("host0") for j in retried.values())
    assert recovered_after < LEASE + HEARTBEAT + 5


def test_a_silently_partitioned_host_stops_its_handlers_before_another_host_takes_over(
        pg: Database, tmp_path: Path) -> None:
    """Issue 32 #2 at the packet level: host 0's link goes down in the middle of its runs (no reset: its
    connections hang). Its handlers, which honour ``job.cancelled``, are stopped by self-fencing (2/3 of the
    lease after the last renewal) before the lease runs out and another host runs the jobs again: no two
    runs of one job at once across hosts, none lost, each finished. The link comes back, and host 0 claims
    and finishes jobs again, then stops cleanly."""
    runs = tmp_path / "runs.log"
    payload = {"first": 4.0, "later": 0.1, "runs": str(runs)}  # attempt 1 outlasts the lease; a retry is quick
    timing = ("--concurrency", "4", "--lease", str(LEASE), "--heartbeat", str(HEARTBEAT))
    with netns.hosts(3) as hosts:
        for host in hosts:
            start_host(host, pg, *timing)
        with Session(pg.engine) as session, session.begin():
            session.add_all([app.Job(kind="patient", payload=payload) for _ in range(16)])

        def held_by_host0() -> set[int]:
            with Session(pg.engine) as session:
                return set(session.scalars(select(app.Job.id).where(
                    app.Job.state == "running", app.Job.locked_by.like("host0%"))))

        deadline = time.monotonic() + 60
        while len(held_by_host0()) < 4:
            assert time.monotonic() < deadline, "host 0 never got to work"
            time.sleep(0.02)
        stranded = held_by_host0()
        hosts[0].cut()
        cut_at = time.time()
        wait_until_finished(pg, 16, timeout=90)
        hosts[0].mend()
        with Session(pg.engine) as session, session.begin():
            session.add_all([app.Job(kind="patient", payload={**payload, "first": 0.3}) for _ in range(40)])
        wait_until_finished(pg, 56, timeout=90)
        stop(hosts)
    host0 = hosts[0].procs[0].pid
    lines = [line.split() for line in runs.read_text().splitlines()]
    by_job: dict[int, list[tuple[float, float, int, str]]] = {}
    for job_id, _attempt, pid, started, ended, how in lines:
        by_job.setdefault(int(job_id), []).append((float(started), float(ended), int(pid), how))
    spans = [Span(job_id, pid, started, ended) for job_id, runs_of in by_job.items()
             for started, ended, pid, _ in runs_of]
    assert overlapping_jobs(spans, {}, {}, time.time()) == [], by_job
    cut_off = [span for job_id in stranded for span in by_job[job_id] if span[2] == host0]
    assert len(cut_off) == len(stranded) and all(how == "cancelled" for *_, how in cut_off), cut_off
    # stopped by self-fencing, before the lease (counted from the last renewal, at most a heartbeat before the cut)
    assert all(ended < cut_at + LEASE for _, ended, _, _ in cut_off), (cut_at, cut_off)
    with Session(pg.engine) as session:
        assert set(session.scalars(select(app.Job.state))) == {"finished"}
        rejoined = session.scalar(select(func.count()).where(app.Job.locked_by.like("host0%"),
                                                             app.Job.id.not_in(stranded)))
    assert rejoined, "host 0 ran nothing after its link came back"


def test_a_partitioned_leader_steps_down_before_its_lease_ends_and_another_host_leads(pg: Database) -> None:
    """Issue 32 #2, the leader: the link of the host that leads (reaps, prunes, keeps the table) goes down
    for longer than the lease. Another host leads within the lease and a reaper pass, in a new term; the cut
    leader learns that it leads no more (its renewal, once it returns, logged), and once its link
    is back it does not take the lead back from the live new leader. It trusts a renewal for 0.8 of the
    lease from before it was sent (``Leadership.is_leader``, tests/test_leader.py), so it did no upkeep past
    its lease even while its renewal hung: the log line comes when the hung renewal returns, during the
    partition if it fails there (a new connection's timeout), or as the link comes back (a renewal sent before
    the cut gets through on TCP's next retransmission, up to seconds later, and finds another term)."""
    timing = ("--concurrency", "2", "--lease", str(LEASE), "--heartbeat", str(HEARTBEAT))
    table = leader_table(app.queue).name

    def leader() -> Any:
        try:
            with pg.engine.connect() as conn:
                return conn.execute(text(f"SELECT holder, term FROM {table}")).first()
        except ProgrammingError:  # the first worker to lead creates the table
            return None

    with netns.hosts(3) as hosts:
        for host in hosts:
            start_host(host, pg, "--log-level", "INFO", *timing)
        deadline = time.monotonic() + 60
        while (old := leader()) is None:
            assert time.monotonic() < deadline, "no host took the lead"
            time.sleep(0.05)
        cut = next(host for host in hosts if old.holder.startswith(f"host{host.index}"))
        cut.cut()
        cut_at = time.time()
        deadline = time.monotonic() + LEASE + HEARTBEAT + 10
        while (new := leader()).holder == old.holder:
            assert time.monotonic() < deadline, "nobody took the lead over from the cut-off host"
            time.sleep(0.05)
        took_over = time.time() - cut_at
        assert new.term > old.term
        time.sleep(LEASE)  # the cut-off host stays cut past its lease
        mended_at = time.time()
        cut.mend()
        time.sleep(2 * LEASE)  # back: it renews its jobs' leases, and must not lead again
        assert leader().holder == new.holder
        others = [host for host in hosts if host is not cut]
        stop(others)
        cut.kill()
        _, said = cut.procs[0].communicate(timeout=30)
    steps = [line for line in said.splitlines() if "stops leading" in line]
    assert steps, said[-3000:]
    stepped_down = datetime.strptime(steps[0][:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert cut_at < stepped_down < mended_at + LEASE, (stepped_down - cut_at, mended_at - cut_at, steps)
    assert took_over < LEASE + HEARTBEAT + 10
