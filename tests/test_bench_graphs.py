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
FAN = [
    "fan-out/fan-in 1 -> N -> 1 (jobs/s)",
    "plain drain of N + 2 jobs (jobs/s)",
    "fan-out/fan-in vs plain drain (target >= 0.70)",
    "fan: root's finish -> first dependent's claim (s)",
    "fan: the N dependents' drain (jobs/s)",
    "fan: the N dependents' drain vs plain drain",
]
CHAIN_AND_ENQUEUE = [
    *(f"chain hop p{p} (ms)" for p in (50, 95, 99)),
    *(f"peer: hop when a handler adds the next, p{p} (ms)" for p in (50, 95, 99)),
    "enqueue without dependencies (jobs/s)",
    "enqueue fan-in K-1 -> 1 (jobs/s)",
    "enqueue chain of K (jobs/s)",
    "fan-in enqueue cost vs none (target <= 1.3)",
    "chain enqueue cost vs none (target <= 1.3)",
]
BATCH = [
    "enqueue_many N as a batch, 3 callbacks (jobs/s)",
    "enqueue_many N, no batch (jobs/s)",
    "batch enqueue_many cost vs none",
]
FIGURES = FAN + CHAIN_AND_ENQUEUE + BATCH
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
    odd = "the fan-out goes first once more than its plain drain; an even --runs gives each order as often"
    assert (odd in result.stderr) == (runs == "1"), result.stderr
    if backend == "sqlite":
        assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither graphs.db nor the scratch file


def test_graphs_pick_scenarios_and_print_json(tmp_path: Path) -> None:
    result = bench(f"sqlite:///{tmp_path / 'graphs.db'}", tmp_path, "--graphs", "enqueue,chain", *TINY,
                   "--runs", "1", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert set(report["medians"]) == set(CHAIN_AND_ENQUEUE), report["medians"]  # no fan-out, no batch: not asked for
    assert all(len(values) == 1 for values in report["runs"].values())
    assert report["settings"]["graphs"] == "enqueue,chain" and report["settings"]["chain_length"] == 8


def test_the_fan_outs_phases_are_read_from_its_own_rows(tmp_path: Path) -> None:
    """The release and the dependents' drain, run by run: the release takes no negative time, the dependents
    drain at least as fast as the whole graph (their span is inside the graph's, and N of N + 2 jobs), and the
    ratio printed is the two figures' quotient."""
    result = bench(server_url("postgresql", tmp_path / "graphs.db"), tmp_path, "--graphs", "fan", *TINY,
                   "--runs", "2", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    runs = json.loads(result.stdout)["runs"]
    assert set(runs) == set(FAN), runs
    n = int(TINY[TINY.index("--fan-out") + 1])
    for i in range(2):
        graph, plain, release, middle, ratio = (runs[name][i] for name in (FAN[0], FAN[1], *FAN[3:]))
        assert release >= 0
        assert middle * (n + 2) / n >= graph, (middle, graph)
        assert ratio == pytest.approx(middle / plain)


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
