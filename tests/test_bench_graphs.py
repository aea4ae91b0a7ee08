"""``sqla-jobs bench --graphs``: the job-graph scenarios, run tiny through the CLI on each backend.

Each run drains a real 1 -> N -> 1 graph and a plain backlog with worker processes, runs two chains with
one listening worker, enqueues with and without dependencies and enqueue_many's a batch; the bench refuses
to print a figure unless every job it timed finished. No speed is asserted (docs/performance.md, "Job
graphs", has the figures and the commands that measure them): only that each figure is there, beside its peer.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forkserver
from tests.conftest import server_url
from tests.test_cli import assert_clean_error, clean_env

pytestmark = pytest.mark.slow

NUMBER = r"-?[\d,]+\.\d\d"
FIGURES = [
    "fan-out/fan-in 1 -> N -> 1 (jobs/s)",
    "plain drain of N + 2 jobs (jobs/s)",
    "fan-out/fan-in vs plain drain (target >= 0.70)",
    *(f"chain hop p{p} (ms)" for p in (50, 95, 99)),
    *(f"peer: hop when a handler adds the next, p{p} (ms)" for p in (50, 95, 99)),
    "enqueue without dependencies (jobs/s)",
    "enqueue fan-in K-1 -> 1 (jobs/s)",
    "enqueue chain of K (jobs/s)",
    "fan-in enqueue cost vs none (target <= 1.3)",
    "chain enqueue cost vs none (target <= 1.3)",
    "enqueue_many N as a batch, 3 callbacks (jobs/s)",
    "enqueue_many N, no batch (jobs/s)",
    "batch enqueue_many cost vs none",
]
TINY = ("--fan-out", "40", "--chain-length", "8", "--jobs", "30", "--latency-samples", "5",
        "--processes", "2", "--concurrency", "4")


def bench(url: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return forkserver.run([sys.executable, "-m", "sqla_jobs.cli", "--log-level", "WARNING", "bench", "--url", url,
                           *args], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=300)



@pytest.mark.parametrize("backend", ["postgresql", "sqlite", "mariadb"])
def test_graphs_print_each_figure_beside_its_peer(backend: str, tmp_path: Path) -> None:
    runs = "2" if backend == "sqlite" else "1"  # two runs once: the scenarios take turns going first
    result = bench(server_url(backend, tmp_path / "graphs.db"), tmp_path, "--graphs", *TINY, "--runs", runs)
    assert result.returncode == 0, result.stdout + result.stderr
    header = f"sqla-jobs bench --graphs on {backend}"
    assert header in result.stdout, result.stdout
    for name in FIGURES:
        assert re.search(rf"^  {re.escape(name)} +{NUMBER}$", result.stdout, re.M), (name, result.stdout)
    assert f"run {runs}/{runs} done" in result.stderr
    if backend == "sqlite":
        assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither graphs.db nor the scratch file


def test_graphs_pick_scenarios_and_print_json(tmp_path: Path) -> None:
    result = bench(f"sqlite:///{tmp_path / 'graphs.db'}", tmp_path, "--graphs", "enqueue,chain", *TINY,
                   "--runs", "1", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert set(report["medians"]) == set(FIGURES[3:-3]), report["medians"]  # no fan-out, no batch: not asked for
    assert all(len(values) == 1 for values in report["runs"].values())
    assert report["settings"]["graphs"] == "enqueue,chain" and report["settings"]["chain_length"] == 8


@pytest.mark.parametrize(("args", "message"), [
    (("--graphs", "fan,tree"), "--graphs takes a comma-separated list of fan, chain, enqueue, batch, got 'fan,tree'"),
    (("--graphs", "--discard-finished"), "not with --discard-finished"),
    (("--graphs", "--soak", "10s"), "--graphs and --soak are two different benches"),
    (("--graphs", "--chain-length", "1"), "--chain-length >= 2"),
])
def test_graphs_refuse_what_they_cannot_measure(args: tuple[str, ...], message: str, tmp_path: Path) -> None:
    result = bench(f"sqlite:///{tmp_path / 'graphs.db'}", tmp_path, *args)
    assert_clean_error(result, 2, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
