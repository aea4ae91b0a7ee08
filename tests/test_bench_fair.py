"""``sqla-jobs bench --fair``: the fair claiming figures, run small through the CLI on each backend.

No speed is asserted (docs/performance.md has the figures and the command that measures them): only that each
figure is printed with a number, which the bench prints once its scenes ran, and that a backlog too small for
the window (or a window too short for any pickup) says so instead of printing a figure of nothing.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests import forkserver
from tests.conftest import server_url
from tests.test_cli import clean_env

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # worker processes draining a backlog: it runs alone

NUMBER = r"-?[\d,]+\.\d\d"
FIGURES = [
    "B..K pickup p99, idle queue (ms)", "A drain, fair (jobs/s)", "B..K pickup p99, fair, A's backlog (ms)",
    "A drain, unfair (jobs/s)", "B..K picked up within the window, unfair (%)",
    "claim of 4, fair, 10,000 keys (ms)", "claim of 4, plain (ms)", "B..K p99: fair with backlog / idle",
    "B..K pickup p99 from the commit, idle queue (ms)", "B..K pickup p99 from the commit, fair, A's backlog (ms)",
    "B..K p99 from the commit: fair with backlog / idle", "B..K pickup p99 of all runs' jobs, idle queue (ms)",
    "B..K pickup p99 of all runs' jobs, fair, A's backlog (ms)", "B..K p99 of all runs' jobs: fair with backlog / idle",
]


@pytest.mark.parametrize("backend", ["postgresql", "sqlite", "mariadb"])
def test_fair_prints_each_figure(backend: str, tmp_path: Path) -> None:
    result = forkserver.run(
        [sys.executable, "-m", "sqla_jobs.cli", "--log-level", "WARNING", "bench", "--url",
         server_url(backend, tmp_path / "fair.db"), "--fair", "--fair-backlog", "3000", "--fair-window", "1",
         "--runs", "1", "--processes", "1", "--concurrency", "4"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"sqla-jobs bench --fair on {backend}" in result.stdout, result.stdout
    starved = "no job of B..K was picked up within a fair window" in result.stdout
    for name in FIGURES:
        # B..K's fair figures are NaN only when none was picked up, and the bench then says so.
        value = rf"({NUMBER}|nan)" if starved and ("fair, A's backlog" in name or "/ idle" in name) else NUMBER
        assert re.search(rf"^  {re.escape(name)} +{value}$", result.stdout, re.M), (name, result.stdout)
    outlasted = re.search(rf"^  scenes whose window outlasted A's backlog +({NUMBER})$", result.stdout, re.M)
    assert outlasted is not None, result.stdout
    # A window that outlasted the backlog is not behind it: the bench says so beside its figures.
    assert (float(outlasted.group(1)) > 0) == ("give a larger --fair-backlog or a shorter" in result.stdout), \
        result.stdout
    ratio = re.search(r"^  A drain: fair / unfair +(\S+)$", result.stdout, re.M)
    assert ratio is not None, result.stdout
    if ratio.group(1) == "nan":
        assert "give a larger --fair-backlog" in result.stdout, result.stdout
    else:
        assert re.fullmatch(NUMBER, ratio.group(1)), result.stdout
