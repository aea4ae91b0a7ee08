"""A worker's settings are checked in one place, whichever way they come (Python, the CLI), and a Python
caller whose engine pool is too small for its concurrency is told so."""

from __future__ import annotations

import argparse
import ast
import inspect
import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, select
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from sqla_jobs import AsyncWorker, ConfigError, Worker
from sqla_jobs.cli.main import build_parser, worker_config
from sqla_jobs.worker.config import WorkerConfig
from tests import app
from tests.conftest import ROOT, Database, run_cli
from tests.helpers import count, enqueue, run_burst
from tests.test_cli import APP, clean_env


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("lease", -1.0, "lease must be > 0 seconds, got -1.0"),
    ("poll_interval", 0.0, "poll_interval must be > 0 seconds, got 0.0"),
    ("grace", -5.0, "grace must be >= 0 seconds, got -5.0"),
    ("batch_size", 0, "batch_size must be at least 1, got 0"),
    ("concurrency", 0, "concurrency must be at least 1, got 0"),
    ("heartbeat", 30.0, "heartbeat (30.0s) must be > 0 and at most lease / 3 (20s)"),
    ("prune_after", -1.0, "prune_after must be >= 0 seconds"),
    ("vacuum_dead_rows", 0,
     "vacuum_dead_rows must be a whole number >= 1 (or None to leave vacuuming to autovacuum), got 0"),
    ("vacuum_dead_rows", 2.5, "vacuum_dead_rows must be a whole number >= 1"),
])
def test_a_bad_setting_is_named_with_its_value(db: Database, setting: str, value: float, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        Worker(db.engine, app.queue, **{setting: value})
    assert message in str(raised.value)


def test_the_cli_names_the_wrong_value() -> None:
    result = run_cli("worker", "--lease", "-1", "--url", "sqlite:///x.db", *APP, env=clean_env())
    assert result.returncode == 2
    # The parser refuses it first, naming the option and the value it got, and nothing else.
    assert "argument --lease: must be > 0, got -1" in result.stderr and "batch_size" not in result.stderr


def test_a_pool_too_small_for_the_concurrency_is_reported(db: Database, caplog: pytest.LogCaptureFixture) -> None:
    small = create_engine(db.url, pool_size=2, max_overflow=0)
    try:
        with caplog.at_level(logging.WARNING, logger="sqla_jobs.worker"):
            Worker(small, app.queue, concurrency=8)
        [warning] = [r.getMessage() for r in caplog.records if "pool" in r.getMessage()]
        assert "holds at most 2 connections" in warning and "pool_size=10" in warning
    finally:
        small.dispose()


def test_a_pool_that_fits_is_not_reported(db: Database, caplog: pytest.LogCaptureFixture) -> None:
    fits = create_engine(db.url, pool_size=10, max_overflow=0)
    try:
        with caplog.at_level(logging.WARNING, logger="sqla_jobs.worker"):
            ids = [enqueue(fits, "noop") for _ in range(3)]
            run_burst(fits, concurrency=8)
        assert not [r for r in caplog.records if "pool" in r.getMessage()]
        assert count(fits, app.Job, app.Job.id.in_(ids), app.Job.state == "finished") == 3
    finally:
        fits.dispose()


def test_prune_after_zero_deletes_finished_jobs_and_keeps_every_other_outcome(db: Database) -> None:
    """``prune_after=0``: the worker holds a discarding copy of the driver (the app's is unchanged) and
    names the setting in its start line; successes (plain, with a result, transactional with and without
    one, after a retry) leave no row, while a cancelled job stays ``cancelled`` and one that failed for
    good is dead-lettered."""
    assert Worker(db.engine, app.queue, prune_after=0).driver.discard_finished
    assert not Worker(db.engine, app.queue, prune_after=60).driver.discard_finished
    assert not app.queue.driver(db.engine).discard_finished
    assert "finished jobs deleted as they finish" in Worker(db.engine, app.queue, prune_after=0).config.summary()
    assert "deleted" not in Worker(db.engine, app.queue).config.summary()
    succeeding = [enqueue(db.engine, "noop"), enqueue(db.engine, "result_value", {"value": 42}),
                  enqueue(db.engine, "once"), enqueue(db.engine, "result_tx"),
                  enqueue(db.engine, "flaky", {"succeed_on": 2})]
    cancelled = enqueue(db.engine, "cancel")
    failing = enqueue(db.engine, "fail", max_attempts=1)
    run_burst(db.engine, prune_after=0)  # the test app retries at once (Backoff(base=0))
    assert count(db.engine, app.Job, app.Job.id.in_(succeeding)) == 0
    assert count(db.engine, app.Once) == 2  # the transactional handlers' writes committed with their deletes
    assert count(db.engine, app.Job, app.Job.id == cancelled, app.Job.state == "cancelled") == 1
    assert count(db.engine, app.DeadJob, app.DeadJob.id == failing) == 1
    assert count(db.engine, app.Job) == 1  # the cancelled job alone (pruned later, as before)


@pytest.mark.parametrize(("batch_size", "claims"), [(None, 1), (40, 4)], ids=["default", "capped"])
def test_a_claim_takes_a_job_for_every_free_thread_unless_batch_size_caps_it(
        db: Database, batch_size: int | None, claims: int) -> None:
    """``batch_size`` defaults to the concurrency: 150 idle threads take 150 waiting jobs in one claim (one
    claim token on every row); capped at 40, the same jobs take four claims (40 + 40 + 40 + 30)."""
    with Session(db.engine) as session, session.begin():
        session.add_all([app.Job(kind="noop", payload={}) for _ in range(150)])
    worker = run_burst(db.engine, concurrency=150, batch_size=batch_size)
    assert worker.config.claim_limit == (batch_size or 150)
    with Session(db.engine) as session:
        tokens = Counter(session.scalars(select(app.Job.claim_token).where(app.Job.state == "finished")))
    assert sum(tokens.values()) == 150
    assert len(tokens) == claims, tokens


# -- each default in one place -----------------------------------------------------------------------------------

SETTINGS = {f.name for f in fields(WorkerConfig) if f.init}


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Engine]:
    engine = create_engine(f"sqlite:///{tmp_path / 'defaults.db'}")
    yield engine
    engine.dispose()


def _command(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


def test_a_worker_given_no_settings_has_worker_configs_defaults(scratch: Engine, tmp_path: Path) -> None:
    """``WorkerConfig``'s fields are where a worker's defaults are written, and the only place: ``Worker``,
    ``AsyncWorker`` and ``sqla-jobs worker``, given nothing (but a name, which is random otherwise), all
    come to the same config."""
    defaults = WorkerConfig(name="w")
    assert Worker(scratch, app.queue, name="w").config == defaults
    async_engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'defaults.db'}")
    assert AsyncWorker(async_engine, app.queue, name="w").config == defaults
    assert worker_config(build_parser().parse_args(["worker", "--name", "w"])) == defaults
    # What the caller gives is all that is passed on: the rest stays the field's default.
    assert Worker(scratch, app.queue, name="w", lease=90.0).config == WorkerConfig(name="w", lease=90.0)
    with pytest.raises(TypeError, match="queue_slots"):  # slots are given as queues={name: slots}
        Worker(scratch, app.queue, queue_slots=(("a", 1),))  # type: ignore[call-arg]


def test_the_cli_options_default_to_worker_config_and_their_help_shows_it() -> None:
    parser = build_parser()
    worker = _command(parser, "worker")
    options = {a.dest: a for a in worker._actions if a.dest in SETTINGS}
    assert set(options) >= {"concurrency", "lease", "heartbeat", "poll_interval", "grace", "name", "vacuum_dead_rows"}
    described = " ".join(worker.format_help().split())  # unwrapped
    for dest, action in options.items():
        if dest == "concurrency":  # None: the default, or with --queue NAME=SLOTS the sum of the slots
            assert action.default is None and f"default {WorkerConfig.concurrency};" in action.help
            continue
        assert action.default == getattr(WorkerConfig, dest), dest
        if action.default is not None:
            assert re.search(rf"\(default: {re.escape(str(action.default))}\)", described), dest
    # The switches are the negation of settings that default to on.
    assert WorkerConfig.listen and WorkerConfig.leader
    assert {a.dest: a.default for a in worker._actions if a.dest in ("no_listen", "no_leader")} == {
        "no_listen": False, "no_leader": False}
    bench = parser.parse_args(["bench"])
    assert (bench.batch_size, bench.vacuum_dead_rows) == (WorkerConfig.batch_size, WorkerConfig.vacuum_dead_rows)


def _documented(heading: str) -> inspect.Signature:
    """The signature docs/reference/api.md prints under ``heading``, as a function's."""
    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    block = page.split(f"## `{heading}`", 1)[1].split("```py\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, object] = {}
    tree = ast.parse("def " + " ".join(block.split()).replace(f"{heading}(", "f(", 1) + ": pass")
    exec(compile(tree, "api.md", "exec"), namespace)
    return inspect.signature(namespace["f"])  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [Worker, AsyncWorker], ids=lambda c: c.__name__)
def test_the_constructors_keep_their_keywords_and_defaults(cls: type) -> None:
    """``Worker(...)`` and ``AsyncWorker(...)`` take ``**settings`` (``WorkerSettings``) yet show, and keep,
    the keyword names and defaults the API reference documents, and those are ``WorkerConfig``'s."""
    shown = inspect.signature(cls)
    documented = _documented(cls.__name__)
    # After the engine (the page calls AsyncWorker's async_engine) and the queue:
    assert [(p.name, p.kind, p.default) for p in list(shown.parameters.values())[2:]] == [
        (p.name, p.kind, p.default) for p in list(documented.parameters.values())[2:]]
    for parameter in shown.parameters.values():
        if parameter.name in SETTINGS - {"concurrency"}:
            assert parameter.default == getattr(WorkerConfig, parameter.name), parameter.name
