"""The bench behind docs/performance.md's "What history costs" section, run small against PostgreSQL.

``docs/bench/history_cost.py`` drains and claims on four tables (plain and partitioned, empty and with
finished rows) in alternating rounds, and refuses to print a figure unless every job its drains and
claims enqueued ended finished, so this run also checks those paths end to end. No speed is asserted
(the figures live in the docs, measured with the command they give).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests.conftest import PG_URL, require_postgres
from tests.test_bench_tuning import NUMBER, _run

pytestmark = pytest.mark.slow  # worker processes, one per drain


def test_history_cost_prints_both_modes_and_drops_its_schemas(tmp_path: Path) -> None:
    require_postgres()
    stdout = _run(tmp_path, "history_cost.py", "--finished", "3000", "--jobs", "400", "--runs", "2",
                  "--samples", "30", "--json", str(tmp_path / "out.json"))
    rows = re.findall(rf"^\| (\w+) \| (drain, jobs/s|claim p95, ms) \| ({NUMBER}) \(.*\) \| ({NUMBER}) \(.*\) \| "
                      rf"({NUMBER}) \(.*\) \|$", stdout, re.M)
    assert [r[:2] for r in rows] == [("plain", "drain, jobs/s"), ("plain", "claim p95, ms"),
                                     ("partitioned", "drain, jobs/s"), ("partitioned", "claim p95, ms")], stdout
    result = json.loads((tmp_path / "out.json").read_text())
    for cells in result["modes"].values():
        assert len(cells["drain_ratio_runs"]) == len(cells["p95_ratio_runs"]) == 2
        assert all(len(cells[state]["walk_runs"]) == 2 for state in ("empty", "history"))
    engine = create_engine(PG_URL)
    with engine.connect() as conn:
        left = conn.execute(text("SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'bench_hist_%'")).scalar_one()
    engine.dispose()
    assert left == 0
