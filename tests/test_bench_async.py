"""``sqla-jobs bench --async``: the drain and the pickup measured on the AsyncWorker, run small through the CLI.

The async bench starts its worker processes as ``sqla-jobs worker --async`` runs (the backend's async driver, an
event loop per process), drains ``async def`` no-ops with them, and times the pickup on an AsyncWorker that runs
on an event loop in a thread of the bench itself. No speed is asserted (docs/performance.md has the figures and
their commands): only that the run ends, reports every figure with a number under the async header, and leaves
no scratch behind. What it cannot tell from outside is which worker class drained: a threaded worker awaits
``async def`` handlers too.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests import forkserver
from tests.conftest import server_url
from tests.test_cli import clean_env

pytestmark = pytest.mark.slow

NUMBER = r"[\d,]+\.\d\d"
FIGURES = ["drain (jobs/s)", "pickup p50 (ms)", "pickup p99 (ms)", "worker peak RSS (MB)", "enqueue_many (jobs/s)"]


@pytest.mark.parametrize("backend", ["postgresql", "sqlite", "mariadb"])
def test_the_async_bench_runs_and_reports_every_figure(backend: str, tmp_path: Path) -> None:
    result = forkserver.run(
        [sys.executable, "-m", "sqla_jobs.cli", "--log-level", "WARNING", "bench", "--url",
         server_url(backend, tmp_path / "async.db"), "--async", "--jobs", "200", "--runs", "1", "--processes", "1",
         "--concurrency", "4", "--latency-samples", "5"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    header = f"sqla-jobs bench on {backend} (async worker, async no-op handlers): 200 jobs, 1 process(es) x 4 handlers"
    assert header in result.stdout, result.stdout
    for name in FIGURES:
        found = re.search(rf"^  {re.escape(name)} +({NUMBER})$", result.stdout, re.M)
        assert found is not None and float(found.group(1).replace(",", "")) > 0, (name, result.stdout)
    assert list(tmp_path.iterdir()) == []  # SQLite's scratch file is gone with the run (the servers': test_bench_stop)
