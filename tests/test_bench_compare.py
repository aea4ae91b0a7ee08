"""The side-by-side benchmark script (docs/bench/compare.py) and its raw-SQL child.

Only what is cheap and deterministic: the script's plumbing, and its children
on a handful of jobs in a scratch schema. No speed is asserted, and nothing is
installed (the peers, which need pip and the network, are left out here).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

from tests import forkserver
from tests.conftest import PG_URL, ROOT, require_postgres

BENCH = ROOT / "docs" / "bench"
DSN = PG_URL.replace("postgresql+psycopg://", "postgresql://")


def load_compare() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_compare", BENCH / "compare.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def schemas_like(prefix: str) -> list[str]:
    with psycopg.connect(DSN) as conn:
        rows = conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE %s", (prefix + "%",)).fetchall()
    return [r[0] for r in rows]


@pytest.fixture
def scratch() -> Iterator[str]:
    require_postgres()
    schema = f"t_cmp_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    yield schema
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def test_help_lists_the_options() -> None:
    out = forkserver.run([sys.executable, str(BENCH / "compare.py"), "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    for option in ("--url", "--jobs", "--runs", "--peers", "--json", "--venv", "--child-timeout"):
        assert option in out


def test_unknown_peer_is_a_clear_error() -> None:
    proc = forkserver.run([sys.executable, str(BENCH / "compare.py"), "--url", DSN, "--peers", "celery"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown celery" in proc.stderr and "pgqueuer" in proc.stderr


def test_raw_sql_child_on_a_few_jobs(scratch: str) -> None:
    proc = forkserver.run(
        [sys.executable, str(BENCH / "raw_sql.py"), "--dsn", DSN, "--schema", scratch, "--jobs", "60",
         "--single-jobs", "15", "--processes", "2", "--batch", "7"],
        capture_output=True, text=True, timeout=120, cwd=BENCH,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("claim1_drain", "claim100_drain", "single_insert", "single_insert_autocommit", "copy_insert"):
        assert isinstance(result[key], float) and result[key] > 0, key
    # Its table lives in the scratch schema (the last step, COPY, leaves exactly --jobs rows there).
    with psycopg.connect(DSN) as conn:
        count = conn.execute(sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(scratch))).fetchone()
    assert count == (60,)


def targets_named(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in report["targets"] if t["name"] == name)


def test_compare_end_to_end_without_peers(tmp_path: Path) -> None:
    """sqla-jobs bench and the raw baselines through the parent script; scratch schemas are dropped."""
    require_postgres()
    out_json = tmp_path / "out.json"
    proc = forkserver.Popen(
        [sys.executable, str(BENCH / "compare.py"), "--url", PG_URL, "--peers", "", "--jobs", "40", "--runs", "1",
         "--latency-samples", "5", "--sqla-jobs-drain", "1x2", "--child-timeout", "120", "--json", str(out_json)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout + stderr
    assert "sqla-jobs drain / raw claim-100 ceiling" in stdout
    report = json.loads(out_json.read_text())
    assert set(report["systems"]) == {"sqla-jobs", "raw"}
    sq = report["systems"]["sqla-jobs"]["medians"]
    assert sq["drain"].keys() == {"1x2"} and sq["drain_best"] > 0
    for key in ("single_enqueue", "single_driver", "bulk_enqueue", "bulk_enqueue_floor", "enqueue_many",
                "pickup_p50_ms", "pickup_p95_ms"):
        assert sq[key] > 0, key
    # Differences of times on a shared machine: only their presence is certain.
    assert all(isinstance(sq[key], float) for key in ("business_job_us", "business_plain_us", "business_raw_us"))
    assert targets_named(report, "sqla-jobs add_all / plain mapped class (floor)")["value"] == pytest.approx(
        sq["bulk_enqueue"] / sq["bulk_enqueue_floor"])
    assert report["systems"]["raw"]["medians"]["claim100_drain"] > 0
    targets = {t["name"]: t for t in report["targets"]}
    assert targets["sqla-jobs drain / pgqueuer best drain"]["met"] is None  # pgqueuer was left out
    assert targets["sqla-jobs drain / raw claim-100 ceiling"]["value"] == pytest.approx(
        sq["drain_best"] / report["systems"]["raw"]["medians"]["claim100_drain"])
    # The raw child's scratch schema (named after the parent's pid) is gone.
    assert [s for s in schemas_like("sqla_jobs_cmp_") if s.endswith(f"_{proc.pid}")] == []


def test_child_failures_are_reported_not_fatal() -> None:
    compare = load_compare()
    with pytest.raises(compare.ChildFailed, match="exited with 3"):
        compare.run_child([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"], 30)
    with pytest.raises(compare.ChildFailed, match="timed out"):
        compare.run_child([sys.executable, "-c", "import time; time.sleep(30)"], 1)
    with pytest.raises(compare.ChildFailed, match="no JSON result"):
        compare.run_child([sys.executable, "-c", "print('hello')"], 30)
    seen: list[int] = []
    with pytest.raises(compare.ChildFailed):
        compare.run_child([sys.executable, "-c", "raise SystemExit(1)"], 30, seen.append)
    assert len(seen) == 1  # the cleanup hook ran, with the child's pid


def test_results_parse_and_medians() -> None:
    compare = load_compare()
    # `sqla-jobs bench --json` prints progress lines, then indented JSON.
    assert compare.parse_result('run 1/1 done\n{\n  "medians": {"a": 1}\n}\n') == {"medians": {"a": 1}}
    assert compare.parse_result('noise\n{"x": 2}\n') == {"x": 2}
    assert compare.parse_result("no json here") is None
    system = compare.System("p", runs=[
        {"system": "p 1", "bulk_enqueue": 10.0, "drain": {"1x1": 5.0, "2x1": 9.0}},
        {"system": "p 1", "bulk_enqueue": 30.0, "drain": {"1x1": 7.0, "2x1": 1.0}},
        {"system": "p 1", "bulk_enqueue": 20.0, "drain": {"1x1": 6.0, "2x1": 2.0}},
    ])
    medians = system.medians()
    assert medians["bulk_enqueue"] == 20.0
    assert medians["drain"] == {"1x1": 6.0, "2x1": 2.0}
    assert (medians["drain_best"], medians["drain_best_setting"]) == (6.0, "1x1")  # best of the medians
    assert compare.libpq_dsn("postgresql+psycopg://u@h:5432/d") == "postgresql://u@h:5432/d"


def test_the_drivers_own_transaction_is_shown_against_pgqueuers_single_enqueue() -> None:
    """The ceiling line: psycopg's BEGIN + INSERT + COMMIT (``sqla-jobs bench``'s "driver alone") over
    pgqueuer's single enqueue, printed beside the targets, and only when both were measured."""
    compare = load_compare()
    args = argparse.Namespace(jobs=10, runs=1)
    sqla_jobs = compare.System("sqla-jobs", runs=[{"single_enqueue": 900.0, "single_driver": 1800.0}])
    pgqueuer = compare.System("pgqueuer", runs=[{"single_enqueue": 2000.0}])
    text, _ = compare.render({"sqla-jobs": sqla_jobs, "pgqueuer": pgqueuer}, args)
    assert re.search(r"ceiling: psycopg alone, BEGIN \+ INSERT \+ COMMIT / pgqueuer single +0\.90\)", text), text
    text, _ = compare.render({"sqla-jobs": sqla_jobs}, args)
    assert "ceiling: psycopg alone" not in text


def test_compare_on_a_private_cluster_measures_there_and_removes_it(tmp_path: Path) -> None:
    """``--private-cluster``: a throwaway server with autovacuum on (history_cost.py's), gone afterwards."""
    require_postgres()  # the same binaries as the shared server's
    out_json = tmp_path / "out.json"
    before = set(Path(tempfile.gettempdir()).glob("sqla-jobs-history-*"))
    proc = forkserver.Popen(
        [sys.executable, str(BENCH / "compare.py"), "--private-cluster", "--peers", "", "--no-raw", "--jobs", "40",
         "--runs", "1", "--latency-samples", "5", "--sqla-jobs-drain", "1x2", "--child-timeout", "120",
         "--json", str(out_json)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout + stderr
    report = json.loads(out_json.read_text())
    assert report["systems"]["sqla-jobs"]["medians"]["drain_best"] > 0
    settings = report["settings"]
    assert settings["private_cluster"] is True
    port = make_url(settings["url"]).port
    assert port is not None and port != make_url(PG_URL).port  # measured on the private server, not the shared one
    assert set(Path(tempfile.gettempdir()).glob("sqla-jobs-history-*")) == before  # its folder is removed
