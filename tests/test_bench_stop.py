"""A stopped bench leaves nothing behind: no worker process, no scratch schema, database or file.

``sqla-jobs bench`` spawns worker processes and makes a scratch schema (PostgreSQL), database
(MariaDB) or file (SQLite). Stopped with SIGTERM it unwinds as Ctrl-C does and exits 130, its
workers stopped and its scratch removed. Killed with SIGKILL it can clean nothing up: its workers
notice it is gone and stop, and the next bench drops the scratch that no running bench holds.
Driven through the CLI in a subprocess, as a user (or a CI job's timeout) stops it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from sqla_jobs.drivers._setup import SCRATCH_PREFIX
from sqla_jobs.drivers.postgresql.bench import LOCK_SPACE
from tests import forkserver
from tests.conftest import ROOT, server_url
from tests.test_cli import clean_env

pytestmark = pytest.mark.slow


def children(pid: int) -> set[int]:
    """The processes whose parent is ``pid``."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def wait_until(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds:g} s waiting for {what}")
        time.sleep(0.2)


def scratch_exists(backend: str, url: str, folder: Path, pid: int) -> bool:
    if backend == "sqlite":
        return (folder / f"sqla-jobs-bench-{pid}.db").exists()
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            query = ("SELECT count(*) FROM pg_namespace WHERE nspname = :name" if backend == "postgresql" else
                     "SELECT count(*) FROM information_schema.schemata WHERE schema_name = :name")
            return bool(conn.execute(text(query), {"name": f"{SCRATCH_PREFIX}{pid}"}).scalar_one())
    finally:
        engine.dispose()


def scratch_holder(url: str, pid: int) -> tuple[str, object]:
    """The state and ``backend_xmin`` of the PostgreSQL session that holds bench ``pid``'s scratch lock."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return tuple(conn.execute(text(
                "SELECT a.state, a.backend_xmin FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid) "
                "WHERE l.locktype = 'advisory' AND l.classid = :space AND l.objid = hashtext(:name)::oid"),
                {"space": LOCK_SPACE, "name": f"{SCRATCH_PREFIX}{pid}"}).one())
    finally:
        engine.dispose()


def start_soak(url: str, out: Path) -> forkserver.Popen:
    """A long, light soak: its two worker processes are up within seconds and it would run for minutes."""
    return forkserver.Popen(
        [sys.executable, "-m", "sqla_jobs.cli", "bench", "--url", url, "--soak", "300s", "--rate", "5",
         "--processes", "2", "--concurrency", "2", "--out", str(out)],
        cwd=ROOT, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def running_workers(bench: forkserver.Popen) -> set[int]:
    """The bench's worker processes, once both run (multiprocessing's resource tracker is a child too)."""
    workers: set[int] = set()

    def both() -> bool:
        workers.clear()
        for child in children(bench.pid):
            command = Path(f"/proc/{child}/cmdline").read_bytes() if alive(child) else b""
            if b"multiprocessing.spawn" in command:
                workers.add(child)
        return len(workers) == 2

    wait_until(both, 60, "the bench's two worker processes")
    return set(workers)


@pytest.fixture
def benches() -> Iterator[list[forkserver.Popen]]:
    """The benches a test starts, killed if a failed assertion left one running."""
    started: list[forkserver.Popen] = []
    yield started
    for bench in started:
        if bench.poll() is None:
            bench.send_signal(signal.SIGTERM)
            bench.communicate(timeout=90)


@pytest.mark.parametrize("backend", ["postgresql", "mariadb", "sqlite"])
def test_a_bench_stopped_or_killed_leaves_no_process_and_no_scratch(
    backend: str, tmp_path: Path, benches: list[forkserver.Popen],
) -> None:
    url = server_url(backend, tmp_path / "bench.db")

    # SIGTERM: it stops its workers, removes its scratch and exits 130 (as after Ctrl-C).
    bench = start_soak(url, tmp_path / "out-term")
    benches.append(bench)
    workers = running_workers(bench)
    wait_until(lambda: scratch_exists(backend, url, tmp_path, bench.pid), 30, "the scratch")
    if backend == "postgresql":  # its lock's session sits idle, not in a transaction that holds back VACUUM
        assert scratch_holder(url, bench.pid) == ("idle", None)
    bench.send_signal(signal.SIGTERM)
    _, stderr = bench.communicate(timeout=90)
    assert bench.returncode == 130, stderr
    assert not any(alive(worker) for worker in workers)
    assert not scratch_exists(backend, url, tmp_path, bench.pid)

    # SIGKILL: the workers stop on their own; the scratch stays until the next bench drops it.
    killed = start_soak(url, tmp_path / "out-kill")
    benches.append(killed)
    workers = running_workers(killed)
    wait_until(lambda: scratch_exists(backend, url, tmp_path, killed.pid), 30, "the scratch")
    killed.kill()
    killed.communicate(timeout=30)
    wait_until(lambda: not any(alive(worker) for worker in workers), 30, "the workers of a killed bench to stop")
    if backend != "mariadb":  # MariaDB's databases are the server's: another test's bench may drop it first
        assert scratch_exists(backend, url, tmp_path, killed.pid)

    after = forkserver.run(
        [sys.executable, "-m", "sqla_jobs.cli", "bench", "--url", url, "--soak", "1s", "--rate", "5",
         "--processes", "1", "--concurrency", "2", "--out", str(tmp_path / "out-after")],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120,
    )
    assert after.returncode == 0, after.stderr
    assert not scratch_exists(backend, url, tmp_path, killed.pid)
