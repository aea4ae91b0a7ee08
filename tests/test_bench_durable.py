"""``sqla-jobs bench --durable``: the durable jobs' figures, run tiny through the CLI on each backend.

No speed is asserted (docs/performance.md, "Durable jobs", has the figures and the commands that measure
them): only that each figure is printed, which the bench does only once every job it timed has finished.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests import forkserver
from tests.conftest import server_url
from tests.test_cli import clean_env

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # bench processes with parked waiters: it runs alone

NUMBER = r"-?[\d,]+\.\d\d"
FIGURES = [
    "step p50 (ms, target p50 <= 2)", "step p99 (ms, target p50 <= 2)",
    "emit -> resume p50 (ms, target p50 <= 5)", "emit -> resume p99 (ms, target p50 <= 5)",
    "worker threads, idle", "worker threads, 30 jobs parked", "worker RSS MB, idle", "worker RSS MB, 30 jobs parked",
    "emit 30 events in one transaction (s)", "all 30 resumed and finished after the commit (s, target <= 5)",
]


@pytest.mark.parametrize("backend", ["postgresql", "sqlite", "mariadb"])
def test_durable_prints_each_figure(backend: str, tmp_path: Path) -> None:
    result = forkserver.run(
        [sys.executable, "-m", "sqla_jobs.cli", "--log-level", "WARNING", "bench", "--url",
         server_url(backend, tmp_path / "durable.db"), "--durable", "--runs", "1", "--latency-samples", "5",
         "--waiters", "30", "--processes", "1", "--concurrency", "4"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"sqla-jobs bench --durable on {backend}" in result.stdout, result.stdout
    for name in FIGURES + (["server connections, 30 jobs parked"] if backend == "postgresql" else []):
        assert re.search(rf"^  {re.escape(name)} +{NUMBER}$", result.stdout, re.M), (name, result.stdout)
