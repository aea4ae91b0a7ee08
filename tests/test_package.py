"""The package surface: the public names, the typing marker, lint."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib import resources

import sqla_jobs
from tests.conftest import ROOT

PUBLIC = [
    "MAX_ERROR_LENGTH",
    "MAX_PAYLOAD_BYTES",
    "MAX_PAYLOAD_DEPTH",
    "AsyncAdmin",
    "AsyncWorker",
    "Backoff",
    "Batch",
    "BatchStatus",
    "BatchSummary",
    "ConfigError",
    "ConnectionProblem",
    "DeadJobMixin",
    "DeadLetters",
    "Enqueued",
    "FairQueue",
    "InvalidJob",
    "JobCancel",
    "JobContext",
    "JobEvent",
    "JobMixin",
    "JobQueue",
    "JobSnooze",
    "JobStateError",
    "NotFound",
    "QueueLength",
    "QueueStats",
    "RunTime",
    "SchemaError",
    "SqlaJobsError",
    "Worker",
    "current_job",
    "limits_table",
    "unique_key",
]


def test_public_names_are_pinned() -> None:
    # Adding or removing a public name is an API change: update this list, docs/reference/api.md and the changelog.
    assert sqla_jobs.__all__ == PUBLIC


#: What the app object offers. The split into a registry half and an operations half
#: (sqla_jobs/_registry.py, sqla_jobs/_admin.py) must not change it.
APP_METHODS = [
    "aio", "batch", "batches", "cancel", "check_job", "check_schema", "create_tables", "dashboard", "driver",
    "emit", "emit_event", "emit_events", "enqueue", "enqueue_many", "enqueue_periodic", "enqueue_unique", "get_dead",
    "get_event",
    "get_job", "handler", "job_steps", "kind_limits", "list_dead", "list_jobs", "listens", "off", "on", "periodic",
    "prune", "purge_dead", "requeue_dead", "result", "retry_delay", "retry_now", "stats", "unknown_kind_message",
    "waiting_for",
]


def test_the_app_offers_its_pinned_methods() -> None:
    assert sorted(name for name in dir(sqla_jobs.JobQueue) if not name.startswith("_")) == APP_METHODS


def test_every_public_name_is_importable_and_documented() -> None:
    namespace: dict[str, object] = {}
    exec(f"from sqla_jobs import {', '.join(PUBLIC)}", namespace)
    for name in PUBLIC:
        assert namespace[name] is getattr(sqla_jobs, name)
    api = (ROOT / "docs" / "reference" / "api.md").read_text()
    missing = [name for name in PUBLIC if f"`{name}" not in api]
    assert not missing, f"docs/reference/api.md does not document {missing}"


#: The public modules besides ``sqla_jobs`` itself (docs/reference/api.md names each).
PUBLIC_MODULES = ["sqla_jobs.testing", "sqla_jobs.errors", "sqla_jobs.metrics", "sqla_jobs.alembic", "sqla_jobs.cli",
                  "sqla_jobs.leader", "sqla_jobs.relay"]


def test_public_modules_are_documented_with_their_names() -> None:
    api = (ROOT / "docs" / "reference" / "api.md").read_text()
    testing = importlib.import_module("sqla_jobs.testing")
    assert [m for m in PUBLIC_MODULES if f"`{m}`" not in api] == []
    assert [n for n in testing.__all__ if f"`{n}" not in api] == []


def test_limits_have_their_documented_values() -> None:
    assert sqla_jobs.MAX_PAYLOAD_BYTES == 1_048_576
    assert sqla_jobs.MAX_ERROR_LENGTH == 4000


def test_py_typed_is_shipped() -> None:
    assert resources.files("sqla_jobs").joinpath("py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'sqla_jobs = ["py.typed"]' in pyproject  # package-data, so wheels carry it too


def test_error_tree() -> None:
    for name in ("InvalidJob", "ConfigError", "SchemaError", "NotFound"):
        assert issubclass(getattr(sqla_jobs, name), sqla_jobs.SqlaJobsError)
    assert issubclass(sqla_jobs.InvalidJob, ValueError)
    assert issubclass(sqla_jobs.NotFound, LookupError)
    assert "create-tables" in str(sqla_jobs.SchemaError())  # the docstring is the default message


def test_ruff_is_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_subpackage_is_shipped() -> None:
    """pyproject lists packages by hand: a new subpackage missing there is missing from the wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "sqla_jobs").rglob("__init__.py")
    }
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
