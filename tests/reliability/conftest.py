"""Fixtures of the fault-injection suite: worker subprocesses, a private PostgreSQL cluster."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, make_url, text

from tests import app
from tests.conftest import IN_CI, Database

from . import cluster as cluster_mod
from . import mariadb_server
from .harness import WorkerProc
from .proxy import TcpProxy

#: The async worker's twins of the test app's handlers (tests/app.py): same effects, awaiting.
ASYNC_KINDS = {"record": "async_record", "once_slow": "async_once", "span": "async_span",
               "poison_span": "async_poison_span"}


class Workers:
    """Starts worker subprocesses; at teardown kills whatever is left and keeps every log.

    ``flavour``: ``threaded`` (``sqla-jobs worker``) or ``async`` (``sqla-jobs worker --async``,
    the AsyncWorker); every scenario that starts workers through this fixture runs with both.
    """

    def __init__(self, tmp_path: Path, flavour: str = "threaded") -> None:
        self.tmp_path = tmp_path
        self.flavour = flavour
        self.started: list[WorkerProc] = []

    def kind(self, name: str) -> str:
        """The handler a scenario enqueues: under the async worker, the ``async def`` twin where there is one."""
        return ASYNC_KINDS.get(name, name) if self.flavour == "async" else name

    def __call__(self, url: str, handler_url: str | None = None, **options: Any) -> WorkerProc:
        if self.flavour == "async":
            options = {"async": True, **options}
        worker = WorkerProc(url, self.tmp_path / f"worker-{len(self.started)}.log", options, handler_url)
        self.started.append(worker.start())
        return worker

    def logs(self) -> list[str]:
        return [w.log() for w in self.started]

    def all_logs(self) -> str:
        return "\n".join(f"--- worker {w.pid} ---\n{w.log()}" for w in self.started)

    def kill_all(self) -> None:
        for worker in self.started:
            if worker.alive():
                worker.signal(signal.SIGKILL)
                worker.wait(10)


@pytest.fixture(params=["threaded", "async"])
def flavour(request: pytest.FixtureRequest) -> str:
    """Which worker the scenario runs: the threaded one, or the AsyncWorker (``--async``)."""
    return str(request.param)


@pytest.fixture
def workers(tmp_path: Path, request: pytest.FixtureRequest, flavour: str) -> Iterator[Workers]:
    pool = Workers(tmp_path, flavour)
    yield pool
    pool.kill_all()
    report = request.node.stash.get(_failed, False)
    if report:
        print(pool.all_logs())


_failed = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    report = yield
    if report.when == "call" and report.failed:
        item.stash[_failed] = True
    return report


def _private(unavailable: Callable[[], str | None], start: Callable[[], Any], what: str) -> Iterator[Any]:
    """A throwaway server this suite may stop and restart (never the shared one): skipped where this machine
    cannot run one, failed in CI."""
    problem = unavailable()
    if problem:
        if IN_CI:
            pytest.fail(f"the tests that stop {what} must run in CI: {problem}")
        pytest.skip(f"cannot start a private {what}: {problem}")
    server = start()
    yield server
    server.destroy()


@pytest.fixture(scope="session")
def private_cluster() -> Iterator[cluster_mod.PrivateCluster]:
    yield from _private(cluster_mod.unavailable, cluster_mod.PrivateCluster, "PostgreSQL server")


@pytest.fixture(scope="session")
def private_mariadb() -> Iterator[mariadb_server.PrivateMariaDB]:
    yield from _private(mariadb_server.unavailable, mariadb_server.PrivateMariaDB, "MariaDB server")


@pytest.fixture
def private_db(private_cluster: cluster_mod.PrivateCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[Database]:
    """The test app's tables on the private cluster."""
    url = make_url(private_cluster.url).render_as_string(hide_password=False)
    engine = create_engine(url, pool_pre_ping=True)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    app.Base.metadata.create_all(engine)
    monkeypatch.setenv("SQLA_JOBS_URL", url)
    app._engine = None
    yield Database("postgresql", url, engine)
    engine.dispose()
    if app._engine is not None:
        app._engine.dispose()
        app._engine = None


@pytest.fixture
def proxy(pg: Database) -> Iterator[TcpProxy]:
    """A TCP proxy in front of the test PostgreSQL, to cut or stall a worker's connection."""
    url = make_url(pg.url)
    server = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    yield server
    server.close()


def via(proxy: TcpProxy, db: Database) -> str:
    """``db``'s URL, going through ``proxy``."""
    return make_url(db.url).set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
