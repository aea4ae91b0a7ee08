"""Fixtures of the relay tests: a database with the relay app's tables, a broker corner, relay processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from tests import forkserver, relay_app
from tests.conftest import BACKENDS, ROOT, Database, make_database

from .brokers import BROKERS, BrokerSpace, require


@pytest.fixture(params=BACKENDS)
def relay_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """An empty database with the relay app's tables, on each backend."""
    for database in make_database(request.param, tmp_path):
        relay_app.queue.create_tables(database.engine)
        yield database


@pytest.fixture
def relay_pg(tmp_path: Path) -> Iterator[Database]:
    """PostgreSQL with the relay app's tables (the long fault tests run there)."""
    for database in make_database("postgresql", tmp_path):
        relay_app.queue.create_tables(database.engine)
        yield database


@pytest.fixture(params=BROKERS)
def space(request: pytest.FixtureRequest) -> Iterator[BrokerSpace]:
    require(request.param)
    corner = BrokerSpace(request.param)
    yield corner
    corner.delete()


class RelayProcess:
    """``sqla-jobs relay`` in a subprocess, its output kept in a log file."""

    def __init__(self, url: str, options: list[str], log_path: Path) -> None:
        self.url = url
        self.options = options
        self.log_path = log_path
        self.proc: forkserver.Popen | None = None
        self._log: IO[str] | None = None

    def start(self) -> RelayProcess:
        self._log = open(self.log_path, "a")  # noqa: SIM115 (closed in stop/kill)
        command = [sys.executable, "-m", "sqla_jobs.cli", "relay", "--app", "tests.relay_app:queue", *self.options]
        env = {**os.environ, "SQLA_JOBS_URL": self.url, "PYTHONPATH": str(ROOT)}
        self.proc = forkserver.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     text=True)
        return self

    def kill(self) -> None:
        """SIGKILL: no goodbye, the jobs in flight stay claimed until their lease runs out."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._close_log()

    def stop(self, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self._close_log()
        return code

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


@pytest.fixture
def relays(tmp_path: Path) -> Iterator[Any]:
    """Start relay subprocesses; whatever is left is killed at teardown."""
    started: list[RelayProcess] = []

    def start(url: str, options: list[str]) -> RelayProcess:
        process = RelayProcess(url, options, tmp_path / "relay.log").start()
        started.append(process)
        return process

    yield start
    for process in started:
        if process.proc is not None and process.proc.poll() is None:
            process.kill()


def wait_for(condition: Any, timeout: float, what: str, every: float = 0.2) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
