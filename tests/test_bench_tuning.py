"""The two benches behind docs/performance.md's "Short jobs" section, run small against PostgreSQL.

``docs/bench/batch_cost.py`` drives the worker's own finish-and-claim statement batch after batch and
``docs/bench/cpu_split.py`` drains through ``sqla-jobs worker`` processes; both refuse to print a
figure unless every job they enqueued ended finished, so these runs are also end-to-end checks of
those paths. No speed is asserted (figures live in the docs, measured with the commands they give).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests import forkserver
from tests.conftest import PG_URL, ROOT, require_postgres

BENCH = ROOT / "docs" / "bench"
NUMBER = r"[\d,]+(?:\.\d+)?"


def _script(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return forkserver.run([sys.executable, str(BENCH / script), "--url", PG_URL, *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def _run(tmp_path: Path, script: str, *args: str) -> str:
    out = _script(tmp_path, script, *args)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_batch_cost_prints_one_row_per_batch_size(tmp_path: Path) -> None:
    require_postgres()
    stdout = _run(tmp_path, "batch_cost.py", "--jobs", "605", "--batches", "8,50", "--runs", "1")
    rows = re.findall(rf"^\| (\d+) \| (\w+) \| ({NUMBER}) \| ({NUMBER}) \|$", stdout, re.M)
    assert [r[:2] for r in rows] == [("8", "kept"), ("50", "kept")], stdout
    assert all(float(ms) > 0 and float(us) > 0 for _, _, ms, us in rows), stdout


def test_batch_cost_times_the_statement_that_deletes_what_it_finishes(tmp_path: Path) -> None:
    """``--discard-finished``: both statements per batch size, and each pass's table checked (kept rows
    all finished, deleted ones all gone) before a figure is printed."""
    require_postgres()
    stdout = _run(tmp_path, "batch_cost.py", "--jobs", "400", "--batches", "50", "--runs", "2",
                  "--discard-finished")
    rows = re.findall(rf"^\| (\d+) \| (\w+) \| ({NUMBER}) \| ({NUMBER}) \|$", stdout, re.M)
    assert [r[:2] for r in rows] == [("50", "kept"), ("50", "deleted")], stdout


def test_batch_cost_refuses_a_backlog_too_small_to_time(tmp_path: Path) -> None:
    require_postgres()
    out = _script(tmp_path, "batch_cost.py", "--jobs", "10", "--batches", "8", "--runs", "1")
    assert out.returncode != 0 and "too few batches of 8" in out.stderr, out.stdout + out.stderr


def test_cpu_split_drains_through_the_cli_at_each_setting(tmp_path: Path) -> None:
    require_postgres()
    stdout = _run(tmp_path, "cpu_split.py", "--jobs", "2000", "--concurrency", "4,16", "--log-level", "WARNING,INFO",
                  "--runs", "1")
    rows = re.findall(rf"^\| 2x(\d+) \| (\w+) \| ({NUMBER}) \| ({NUMBER}) \| ({NUMBER}) \| (\d+)% \|$", stdout, re.M)
    assert [(r[0], r[1]) for r in rows] == [("4", "WARNING"), ("4", "INFO"), ("16", "WARNING"), ("16", "INFO")], stdout
    # The workers did the work: their CPU per job is above zero at every setting.
    assert all(float(r[3]) > 0 for r in rows), stdout


# Serial: the script reads the WAL written between two points as the cluster's LSN moves, so any other test's
# writes meanwhile count too (a parallel CI run once put the moved row above the kept one).
@pytest.mark.serial
def test_finish_cost_times_the_four_finishes_and_drops_its_schema(tmp_path: Path) -> None:
    """docs/bench/finish_cost.py: each finish ran over every job (the script checks the count), the row kept
    writes more WAL than the row moved, which writes more than the row deleted; only the table whose indexes
    leave the finished columns alone gets HOT updates; no scratch schema is left."""
    require_postgres()
    result = json.loads(_run(tmp_path, "finish_cost.py", "--jobs", "500", "--runs", "2", "--json"))
    assert set(result) == {"update", "delete", "move", "hot"}
    assert all(len(r["us_runs"]) == 2 and r["us_per_job"] > 0 for r in result.values()), result
    wal = {name: r["wal_bytes_per_job"] for name, r in result.items()}
    assert wal["update"] > wal["move"] > wal["delete"], wal
    hot = {name: r["hot_share"] for name, r in result.items()}
    assert hot["update"] == hot["delete"] == hot["move"] == 0 and hot["hot"] > 0.2, hot
    engine = create_engine(PG_URL)
    with engine.connect() as conn:
        left = conn.execute(text("SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'bench_finish_%'")).scalar_one()
    engine.dispose()
    assert left == 0
