"""``sqla-jobs bench --soak``: the report's shape and its promise that every enqueued job ran once.

Short soaks at a low rate, driven through the CLI in a subprocess as a user
runs them. No speed is asserted: only the structure of the report, the files,
and that the producer's jobs were all run, exactly once, by real worker processes.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forkserver
from tests.conftest import PG_URL, ROOT, require_postgres, server_url
from tests.test_cli import clean_env

pytestmark = pytest.mark.slow

BENCH = ROOT / "docs" / "bench"


def soak(url: str, out: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return forkserver.run(
        [sys.executable, "-m", "sqla_jobs.cli", "bench", "--url", url, "--soak", "12s", "--rate", "40",
         "--window", "3s", "--processes", "2", "--concurrency", "4", "--soak-prune", "2s", "--out", str(out),
         "--json", *extra],
        cwd=out.parent, env=clean_env(), capture_output=True, text=True, timeout=timeout,
    )



# Not in the serial phase: at 40 jobs/s a soak barely loads the machine, and it asserts no time or speed (its
# producer catches up after a late tick, so the count of jobs it enqueued holds under the parallel phase's load).
@pytest.mark.parametrize("backend", ["postgresql", "sqlite", "mariadb"])
def test_soak_runs_every_job_once_and_reports_each_window(backend: str, tmp_path: Path) -> None:
    out = tmp_path / "results"
    # PostgreSQL also VACUUMs the table by hand and sets a storage parameter: what its driver alone can do.
    pg_only = ("--soak-vacuum", "4s", "--storage", "autovacuum_vacuum_scale_factor=0.01")
    extra = pg_only if backend == "postgresql" else ()
    result = soak(server_url(backend, tmp_path / "soak.db"), out, *extra)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)

    totals = report["totals"]
    assert totals["enqueued"] >= 400  # 12 s at 40/s, less a tick or two
    assert totals["run"] == totals["enqueued"]
    assert (totals["missing"], totals["duplicates"], totals["pending_left"], totals["dead"]) == (0, 0, 0, 0)
    assert report["complete"] is True
    assert totals["pruned"] > 0  # finished jobs older than 2 s went while the producer ran

    windows = report["windows"]
    soaking = [w for w in windows if w["phase"] == "soak"]
    assert len(soaking) == 4 and [w["start"] for w in soaking] == [0, 3, 6, 9]
    assert all(w["phase"] == "drain" for w in windows[4:])
    assert sum(w["run_per_s"] * 3 for w in windows) == pytest.approx(totals["run"])
    assert sum(w["enqueued_per_s"] * 3 for w in windows) == pytest.approx(totals["enqueued"])
    for w in soaking:
        assert w["run_per_s"] > 0 and w["pickup_p50_ms"] <= w["pickup_p95_ms"] <= w["pickup_p99_ms"]
    if backend == "mariadb":
        assert all(w["table_bytes"] is None for w in windows)  # the driver says nothing it cannot measure
    else:
        assert all(w["table_bytes"] > 0 and w["index_bytes"] > 0 for w in windows)
    if backend == "postgresql":  # pg_stat_user_tables' figures
        assert all(w["dead_tuples"] is not None and w["autovacuum_runs"] is not None for w in windows)
        assert any(w["dead_tuples"] > 0 for w in windows)
        assert totals["vacuums"] >= 2 and sum(w["vacuum_runs"] for w in windows) >= 2
        assert totals["server_autovacuum"] in ("on", "off")
        assert report["settings"]["storage"] == {"autovacuum_vacuum_scale_factor": "0.01"}
    else:
        assert totals["server_autovacuum"] is None and totals["vacuums"] == 0

    files = report["files"]
    assert Path(files["json"]).exists() and json.loads(Path(files["json"]).read_text())["sqla-jobs"]["totals"]
    with open(files["csv"]) as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(windows) and {"system", "pickup_p99_ms", "pending", "dead_tuples"} <= set(rows[0])
    assert Path(files["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "windows of 3s" in result.stderr and "wrote png" in result.stderr
    if backend == "sqlite":
        assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]  # no scratch file left behind


@pytest.mark.parametrize(("option", "message"), [
    (("--rate", "fast"), "--rate: 'fast' is neither a number of jobs per second nor 'max'"),
    (("--storage", "fillfactor"), "--storage: 'fillfactor' is not NAME=VALUE, e.g. fillfactor=70"),
    (("--storage", "fillfactor=70"), "--storage: sqlite has no table storage parameters (they are PostgreSQL's)"),
    (("--soak-vacuum", "5s"), "--soak-vacuum: sqlite has no VACUUM of one table (it is PostgreSQL's)"),
    (("--faults", "1", "--fault-every", "soon"), "--fault-every: 'soon' is not MIN-MAX seconds, e.g. 30-60"),
    (("--faults", "1", "--fault-every", "5-2"), "--fault-every: '5-2' needs 0 < MIN <= MAX, e.g. 30-60"),
])
def test_soak_says_what_is_wrong_with_its_options(tmp_path: Path, option: tuple[str, str], message: str) -> None:
    result = soak(f"sqlite:///{tmp_path / 'x.db'}", tmp_path / "out", *option, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"sqla-jobs: {message}"


def test_a_soak_under_faults_finishes_every_job_once(tmp_path: Path) -> None:
    """docs/bench: ``--faults SEED`` kills, stops, stalls workers and cuts their connections; the fleet keeps
    its size, and every job finishes (counted in the database) with nothing left or dead-lettered."""
    require_postgres()
    out = tmp_path / "results"
    result = forkserver.run(
        [sys.executable, "-m", "sqla_jobs.cli", "bench", "--url", PG_URL, "--soak", "30s", "--rate", "100",
         "--window", "5s", "--processes", "2", "--concurrency", "4", "--faults", "46", "--fault-every", "2-4",
         "--out", str(out), "--json"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    totals = report["totals"]
    kinds = [fault["kind"] for fault in totals["faults"]]
    # Seed 46 draws cut, term, kill, then a stall (which holds the next fault back 15 s).
    assert {"kill", "term", "stall", "cut"} <= set(kinds) and "stuck" not in kinds, totals["faults"]
    assert totals["enqueued"] >= 2_900
    assert (totals["run"], totals["missing"], totals["pending_left"], totals["dead"]) == (totals["enqueued"], 0, 0, 0)
    assert report["complete"] is True and report["settings"]["faults"] == 46
    stall = next(fault for fault in totals["faults"] if fault["kind"] == "stall")
    assert stall["detail"].endswith("stopped for 15s"), stall  # one and a half leases of 10 s


def test_compare_soak_writes_one_report_for_the_systems_it_ran(tmp_path: Path) -> None:
    """compare.py --soak without peers (they need pip): the sqla-jobs side, in the combined files."""
    require_postgres()
    proc = forkserver.run(
        [sys.executable, str(BENCH / "compare.py"), "--url", PG_URL, "--peers", "", "--soak", "6", "--rate", "30",
         "--window", "3", "--sqla-jobs-soak", "1x4", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| sqla-jobs |" in proc.stdout and "| yes |" in proc.stdout
    combined = json.loads((tmp_path / "compare-soak.json").read_text())
    assert list(combined) == ["sqla-jobs"] and combined["sqla-jobs"]["complete"]
    assert (tmp_path / "compare-soak.png").exists() and (tmp_path / "compare-soak.csv").exists()
