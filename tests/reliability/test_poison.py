"""Poison isolation: a job that kills its worker process condemns no job that merely shared the process.

``sqla-jobs worker --processes 2`` with its defaults (4 threads, a 60 s lease,
``max_attempts`` 5), one job whose handler ends the process with
``os._exit(1)`` and 20 ordinary jobs: the supervisor hands the dead process's
jobs back at once (no 60 s lease to wait for), each runs next alone in its
process, so the poison is dead-lettered after at most ``max_attempts``
crashes and every other job finishes. On a SQLite file and on PostgreSQL.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests import forkserver
from tests.conftest import ROOT, Database

from .harness import all_settled, check_invariants, dead, effects, enqueue, job, wait_for

pytestmark = pytest.mark.slow

MAX_ATTEMPTS = 5  # the default, which the test relies on: no job sets its own


def test_poison_job_under_processes_condemns_no_other_job(db: Database, tmp_path: Path) -> None:
    # The poison first, so the first claim takes it together with three ordinary jobs.
    [poison] = enqueue(db.engine, "poison")
    ordinary = enqueue(db.engine, "sleep", {"seconds": 0.3}, n=20)
    ids = [poison, *ordinary]
    log_path = tmp_path / "supervisor.log"
    with open(log_path, "wb") as log_file:
        supervisor = forkserver.Popen(
            [sys.executable, "-m", "sqla_jobs.cli", "worker", "--app", "tests.app:queue", "--processes", "2"],
            env=db.env(), cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
        )
        try:
            # Generous: the whole run takes a few seconds; without the supervisor's hand-back each crash
            # would wait a 60 s lease, and without isolation ordinary jobs end dead-lettered instead.
            wait_for(lambda: all_settled(db.engine, ids), 150, "every job to finish or be dead-lettered")
        finally:
            supervisor.send_signal(signal.SIGTERM)
            try:
                supervisor.wait(60)
            except subprocess.TimeoutExpired:
                supervisor.kill()
                supervisor.wait(10)
    log = log_path.read_text(errors="replace")
    assert supervisor.returncode == 0, log

    found = check_invariants(db.engine, ids, [log])
    condemned = sorted(i for i in ordinary if found[i] != "finished")
    assert not condemned, f"ordinary jobs not finished: {condemned} ({[found[i] for i in condemned]})\n{log}"
    assert found[poison] == "dead", log

    # Every start of the poison ended its process: the starts are the crashes, and the supervisor saw each.
    crashes = len(effects(db.engine, poison, "start"))
    assert 1 <= crashes <= MAX_ATTEMPTS, f"the poison crashed {crashes} processes\n{log}"
    assert len(re.findall(r"worker process \d+ exited with 1;", log)) == crashes, log
    row = dead(db.engine, poison)
    assert row.attempts == crashes == MAX_ATTEMPTS, "each crash counted one attempt, the last dead-lettered it"
    assert "WorkerLost" in row.last_error and "exited with 1" in row.last_error

    # The scenario did what it claims: ordinary jobs shared a process with the poison when it crashed...
    shared = [i for i in ordinary if any("WorkerLost" in e["error"] for e in (job(db.engine, i).errors or []))]
    assert shared, f"no ordinary job ever shared a process with the poison: the test proves nothing\n{log}"
    for job_id in ordinary:
        assert job(db.engine, job_id).attempts <= 2, f"job {job_id} was lost more than once\n{log}"
    # ...and each then ran alone in its process (PostgreSQL's clock has the resolution to show it).
    if db.backend == "postgresql":
        runs: dict[tuple[int, int], dict[str, object]] = defaultdict(dict)
        for e in effects(db.engine):
            runs[(e.job_id, e.attempt)][e.event] = e
        for job_id in shared:
            attempt = job(db.engine, job_id).attempts
            mine = runs[(job_id, attempt)]
            pid, begin, end = mine["start"].pid, mine["start"].at, mine["finish"].at  # type: ignore[attr-defined]
            for (other, other_attempt), run in runs.items():
                start = run.get("start")
                if other == job_id or start is None or start.pid != pid:  # type: ignore[attr-defined]
                    continue
                finish = run.get("finish")
                other_end = finish.at if finish is not None else start.at  # type: ignore[attr-defined]
                assert other_end < begin or start.at > end, (  # type: ignore[attr-defined]
                    f"job {job_id} ran its isolated attempt {attempt} beside job {other} "
                    f"attempt {other_attempt} in process {pid}")
